//! Host memory: a large allocation is checked before it is made.
//!
//! Rust aborts the process when an allocation fails, and on Linux a request larger than the free
//! memory often succeeds (overcommit) and gets the process killed later, when the pages are
//! touched. Either way the user sees a crash, not a reason. So every allocation whose size comes
//! from a spec, a weight file or an input (parameters, activations, dequantized weights) first
//! asks [`check`]: is the size within the memory available now, and does the system agree to
//! reserve it (which honours `ulimit -v` and cgroup limits)? The answer is a [`MemoryError`] that
//! names what was being allocated and both sizes.

use std::fmt;

/// Requests below this are not checked: they cannot matter, and checking reads `/proc`.
pub const CHECKED_BYTES: u64 = 64 << 20;

/// An allocation that would not fit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct MemoryError {
    /// What was being allocated.
    pub what: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Bytes available when it was asked for, where the system says.
    pub available: Option<u64>,
}

impl fmt::Display for MemoryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: needs {} of memory", self.what, human(self.bytes))?;
        match self.available {
            Some(available) if available < self.bytes => write!(f, ", more than the {} available", human(available)),
            _ => write!(f, ", which the system refused to allocate"),
        }
    }
}

/// Checks that `bytes` for `what` can be allocated now: at most the available memory
/// ([`available`]), and reservable (a trial reservation, released at once, that fails under
/// `ulimit -v`). Requests below [`CHECKED_BYTES`] always pass.
pub fn check(what: impl FnOnce() -> String, bytes: u64) -> Result<(), MemoryError> {
    if bytes < CHECKED_BYTES {
        return Ok(());
    }
    let available = available();
    let fits = available.is_none_or(|a| bytes <= a) && usize::try_from(bytes).is_ok_and(reservable);
    match fits {
        true => Ok(()),
        false => Err(MemoryError { what: what(), bytes, available }),
    }
}

/// Whether `len` bytes can be reserved: a trial reservation, released at once. It maps address
/// space without touching it, so it costs no memory; `black_box` keeps the optimizer from
/// eliding the unused allocation.
fn reservable(len: usize) -> bool {
    let mut trial: Vec<u8> = Vec::new();
    let ok = trial.try_reserve_exact(len).is_ok();
    std::hint::black_box(&trial);
    ok
}

/// `f32` elements as bytes, saturating (a count that overflows is refused by [`check`] anyway).
pub fn f32_bytes(elements: u128) -> u64 {
    u64::try_from(elements.saturating_mul(4)).unwrap_or(u64::MAX)
}

/// Bytes of memory available to this process now, where the system says (Linux: the kernel's
/// `MemAvailable` estimate, lowered to what the cgroup's `memory.max` leaves); `None` elsewhere.
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let system = meminfo_field(&meminfo, "MemAvailable:")?;
    Some(cgroup_headroom().map_or(system, |h| h.min(system)))
}

/// `MemAvailable:   123456 kB` → bytes.
fn meminfo_field(meminfo: &str, field: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.trim_start_matches(field).trim().trim_end_matches("kB").trim().parse().ok()?;
    kb.checked_mul(1024)
}

/// What the cgroup (v2) limit leaves: `memory.max` − `memory.current`, if there is a limit.
fn cgroup_headroom() -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{name}")).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max" (no limit) does not parse
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// `1536` → `1.5 KiB`.
pub fn human(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64;
    let mut unit = "bytes";
    for next in ["KiB", "MiB", "GiB", "TiB", "PiB"] {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = next;
    }
    format!("{value:.1} {unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(512), "512 bytes");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(8 << 30), "8.0 GiB");
        assert_eq!(human(1 << 42), "4.0 TiB");
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        let meminfo = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_field(meminfo, "MemAvailable:"), Some(20_000_000 * 1024));
        assert_eq!(meminfo_field(meminfo, "SwapFree:"), None);
    }

    #[test]
    fn small_requests_pass_and_impossible_ones_are_refused() {
        assert!(check(|| "a little".into(), 1024).is_ok());
        let err = check(|| "random parameters".into(), 1 << 60).unwrap_err();
        assert!(err.to_string().starts_with("random parameters: needs 1024.0 PiB of memory"), "{err}");
    }
}
