//! `kiln bench calibrate`: the cost model's constants measured on the device, next to the
//! built-in ones.

use super::DeviceArgs;
use crate::progress::Reporter;
use anyhow::Result;
use kiln_compiler::optimize::CostModel;
use kiln_runtime::Device;
use kiln_runtime::measure::Constants;

/// Arguments of `kiln bench calibrate`.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    device: DeviceArgs,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `kiln bench calibrate`.
pub fn run(args: CalibrateArgs, reporter: &Reporter) -> Result<()> {
    calibrate(&args.device.open(reporter, args.json)?, args.json)
}

/// `kiln bench calibrate`: the cost model's constants measured on the device (see
/// [`kiln_runtime::measure::constants`]), printed in the cost model's unit (one byte moved) next to
/// the defaults; a GPU adapter's are kept as its cost model, for the optimizer.
fn calibrate(device: &Device, json: bool) -> Result<()> {
    let runs = 5;
    let (constants, saved) = device.calibrate(runs)?;
    let Constants { dispatch_ms: t_dispatch, byte_ms: t_byte, flop_ms: t_flop, scalar_projection } = constants;
    let CostModel { dispatch, flop, .. } = constants.cost_model();
    let default = kiln_compiler::target::Target::named(device.name()).map_or_else(CostModel::default, |t| t.cost);
    if json {
        let out = serde_json::json!({
            "backend": device.name(),
            "adapter": device.describe(),
            "features": features(device),
            "dispatch_us": t_dispatch * 1e3, "byte_ns": t_byte * 1e6, "gflops": 1e-6 / t_flop,
            "measured": {"dispatch": dispatch, "flop": flop, "scalar_projection": scalar_projection},
            "default": {"dispatch": default.dispatch, "flop": default.flop, "scalar_projection": default.scalar_projection},
            "saved": saved,
            "note": saved.is_none().then(|| not_cached(device)),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("cost model calibration on {} (medians of {runs})", device.describe());
        if let Some(features) = features(device) {
            println!("  features          {features}");
        }
        println!("  one dispatch      {:>10.1} us", t_dispatch * 1e3);
        println!("  one byte moved    {:>10.4} ns   ({:.2} GB/s)", t_byte * 1e6, 1e-6 / t_byte);
        println!("  one matmul FLOP   {:>10.4} ns   ({:.2} GFLOPS)", t_flop * 1e6, 1e-6 / t_flop);
        println!("  scalar projection {scalar_projection:>10.2} x the vec4 form's time");
        println!("  in bytes:  dispatch = {dispatch:.0}  flop = {flop:.3}  scalar projection = {scalar_projection:.2}");
        println!(
            "  defaults:  dispatch = {:.0}  flop = {:.3}  scalar projection = {:.2}",
            default.dispatch, default.flop, default.scalar_projection
        );
        match saved {
            Some(path) => println!("  saved as this adapter's cost model: {}", path.display()),
            None => println!("  {}", not_cached(device)),
        }
    }
    Ok(())
}

/// A GPU adapter's features that bear on kiln's kernels (see [`kiln_runtime::gpu::Gpu::features`]).
fn features(device: &Device) -> Option<&str> {
    match device {
        Device::Gpu(gpu) => Some(gpu.features()),
        _ => None,
    }
}

/// Why a calibration off wgpu is not kept: the CPU's (and the interpreter's) cost model is built
/// into kiln, so these figures are for reading only.
fn not_cached(device: &Device) -> String {
    format!(
        "nothing cached: the `{}` backend's cost model is built in (the defaults above) and is not replaced by a \
         calibration; only a wgpu adapter's measured constants are cached and used",
        device.name()
    )
}
