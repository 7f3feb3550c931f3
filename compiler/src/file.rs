//! Writing files so that no reader ever sees half of one.
//!
//! Everything kiln writes (artifacts, output tensors, rendered graphs and reports) goes through
//! [`write_atomic`] — or, for a file too large to hold in memory (a corpus's token file),
//! [`AtomicFile`], which streams into the same temporary file and renames it the same way: a
//! process killed while writing, or a machine that loses power, leaves the previous file or the
//! new one at the path, never a truncated file that a later run would misread. A log that grows
//! as a run goes ([`AppendLog`], a training run's JSON lines) is the one file written in place: each
//! line goes out whole in one write, and a reader skips a last line cut short. (`tests/cli/atomic_writes.rs` kills writers mid-write, and checks that nothing else in
//! the sources writes files directly.)

use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: into a hidden temporary file next to it
/// (`.NAME.tmp-PID`), flushed to disk, then renamed over `path`. A symbolic link is written
/// through (its target is replaced). A path that exists and is not a regular file (`/dev/null`,
/// a pipe, a terminal) is written directly, since renaming over it would replace the device with
/// a file. On failure the temporary file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)?,
        _ => path.to_path_buf(),
    };
    if std::fs::metadata(&path).is_ok_and(|m| !m.is_file()) {
        return std::fs::write(&path, bytes);
    }
    let tmp = temporary(&path)?;
    let written = write_synced(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A file written as a stream and put in place at the end ([`AtomicFile::commit`]): until then
/// it is a hidden temporary file next to `path`, removed if the writer is dropped uncommitted.
pub struct AtomicFile {
    out: io::BufWriter<std::fs::File>,
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Starts writing `path` (a regular file, or one to be created).
    pub fn start(path: &Path) -> io::Result<AtomicFile> {
        let tmp = temporary(path)?;
        let out = io::BufWriter::new(std::fs::File::create(&tmp)?);
        Ok(AtomicFile { out, tmp, path: path.to_path_buf(), committed: false })
    }

    /// Flushes what was written to disk and renames it over `path`.
    pub fn commit(mut self) -> io::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        std::fs::rename(&self.tmp, &self.path)?;
        self.committed = true;
        Ok(())
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A log of lines that grows as a run goes: opened to append (or new), each line written whole
/// in one `write` call and flushed, so that a run stopped at any moment keeps every line before.
pub struct AppendLog {
    file: std::fs::File,
}

impl AppendLog {
    /// Opens `path` to append to it, created if absent.
    pub fn open(path: &Path) -> io::Result<AppendLog> {
        Ok(AppendLog { file: std::fs::OpenOptions::new().create(true).append(true).open(path)? })
    }

    /// Appends `line` and a newline.
    pub fn line(&mut self, line: &str) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        self.file.write_all(&bytes)?;
        self.file.flush()
    }
}

/// Whether [`write_atomic`] could write `path`, checked without touching it: a device is
/// opened for writing (not truncated); otherwise the temporary file `write_atomic` would make
/// next to it is created and removed. Commands call it before long work, so that an unwritable
/// output is refused at once rather than after the model ran. A directory is an error.
pub fn check_writable(path: &Path) -> io::Result<()> {
    let path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)?,
        _ => path.to_path_buf(),
    };
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => {
            return Err(io::Error::new(io::ErrorKind::IsADirectory, "it is a directory, not a file"));
        }
        Ok(m) if !m.is_file() => return std::fs::OpenOptions::new().write(true).open(&path).map(drop),
        _ => {}
    }
    let tmp = temporary(&path)?;
    std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
    std::fs::remove_file(&tmp)
}

/// `dir/.NAME.tmp-PID` for `dir/NAME`.
fn temporary(path: &Path) -> io::Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("`{}` does not name a file", path.display()))
    })?;
    Ok(path.with_file_name(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id())))
}

/// Writes a new file and flushes it to disk.
fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = std::fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-file-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn replaces_a_file_and_leaves_no_temporary() {
        let dir = scratch("replace");
        let path = dir.join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        write_atomic(&path, b"new contents").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new contents");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["out.bin"]);
    }

    #[test]
    fn writes_through_a_link_and_into_devices() {
        let dir = scratch("link");
        let target = dir.join("target.bin");
        let link = dir.join("link.bin");
        std::fs::write(&target, b"old").unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&target, &link).unwrap();
            write_atomic(&link, b"new").unwrap();
            assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
            assert_eq!(std::fs::read(&target).unwrap(), b"new");
            // `/dev/null` stays a device.
            write_atomic(Path::new("/dev/null"), b"nothing").unwrap();
            assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
        }
    }

    #[test]
    fn a_streamed_file_appears_whole_at_commit_and_not_at_all_when_dropped() {
        let dir = scratch("stream");
        let path = dir.join("tokens.bin");
        let mut f = AtomicFile::start(&path).unwrap();
        f.write_all(b"abc").unwrap();
        assert!(!path.exists());
        f.commit().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
        let mut f = AtomicFile::start(&path).unwrap();
        f.write_all(b"half").unwrap();
        drop(f);
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["tokens.bin"]);
    }

    #[test]
    fn a_log_appends_whole_lines() {
        let dir = scratch("log");
        let path = dir.join("log.jsonl");
        AppendLog::open(&path).unwrap().line("one").unwrap();
        AppendLog::open(&path).unwrap().line("two").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\n");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file() {
        let dir = scratch("fail");
        let path = dir.join("missing-dir").join("out.bin");
        assert!(write_atomic(&path, b"x").is_err());
        assert!(write_atomic(Path::new("/"), b"x").is_err());
    }

    #[test]
    fn writability_is_checked_without_a_trace() {
        let dir = scratch("writable");
        let path = dir.join("out.bin");
        check_writable(&path).unwrap();
        assert!(!path.exists(), "nothing is left behind");
        std::fs::write(&path, b"old").unwrap();
        check_writable(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert!(check_writable(&dir.join("missing-dir").join("out.bin")).is_err());
        assert!(check_writable(&dir).is_err());
        #[cfg(unix)]
        check_writable(Path::new("/dev/null")).unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["out.bin"]);
    }
}
