//! The profiler: [`GpuModel::profile`] times each step of a plan on the device's clock (timestamp
//! queries) or, lacking them, on the host's.

#![expect(
    clippy::indexing_slicing,
    reason = "steps index tables of one entry per step, and query results of two per step, built here"
)]

use super::run::DIMS_STRIDE;
use super::{GpuError, GpuModel};
use kiln_compiler::back::wgsl::workgroups;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// Which clock [`GpuModel::profile`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// Timestamps the device wrote at the start and end of each step's compute pass.
    Device,
    /// The host's clock around the submission of each step alone and the wait for it (the
    /// device lacks `TIMESTAMP_QUERY`); includes the submission's overhead.
    Host,
}

/// Time of each step of a plan, from [`GpuModel::profile`].
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// The clock the times were read from.
    pub clock: Clock,
    /// Seconds per step of the plan ([`Plan::steps`]), in order; `None` for a step with nothing
    /// to compute at these sizes (not dispatched).
    ///
    /// [`Plan::steps`]: kiln_compiler::lower::Plan::steps
    pub seconds: Vec<Option<f64>>,
}

impl GpuModel {
    /// Times every step of the plan on `given` inputs. A forward pass first binds the inputs and
    /// sizes every buffer (and warms the pipelines); then the steps are dispatched again in order,
    /// each in a compute pass of its own on the same buffers and sizes (so each reads what it
    /// reads in a forward pass), and each is timed: between timestamps
    /// written by the device at the pass's start and end where the device has `TIMESTAMP_QUERY`
    /// ([`Clock::Device`]), else by the host around a submission of that pass alone, waiting for
    /// it ([`Clock::Host`], which includes the submission's overhead).
    pub fn profile(&self, given: &HashMap<String, Tensor>) -> Result<Profile, GpuError> {
        self.run(given)?;
        let gpu = &self.gpu;
        let state = self.state.lock().map_err(|_| GpuError::Poisoned("run state"))?;
        // Every step's pipeline, bind group and grid, as the run above dispatched them, and its
        // second dispatch's where it had one (a split attention's combine, timed with the step).
        let grid_at = |slot: usize| -> Result<Option<(u32, u32)>, GpuError> {
            let offset = slot * DIMS_STRIDE as usize;
            let threads = state
                .dims
                .get(offset..offset + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
                .ok_or_else(|| GpuError::Internal(format!("slot {slot} has no dispatch size")))?;
            Ok(match threads {
                0 => None,
                t => Some(workgroups(t, gpu.limits.max_compute_workgroups_per_dimension)),
            })
        };
        let mut dispatches = Vec::with_capacity(self.program.plan.steps.len());
        // (The optimizer's steps of a whole training step, from `tail.first` on, bind their own
        // groups: `super::update`.)
        let tail = self.tail.as_ref();
        let steps = self.program.plan.steps.len();
        for (i, cached) in state.bind_groups.iter().enumerate().take(tail.map_or(steps, |t| t.first)) {
            let (pipeline, _, group) =
                cached.as_ref().ok_or_else(|| GpuError::Internal(format!("step {i} has no bind group")))?;
            let second = match (state.second_slots.get(i).copied().flatten(), state.second_groups.get(i)) {
                (Some(slot), Some(Some((pipeline, _, group)))) => grid_at(slot)?.map(|grid| (pipeline, group, grid)),
                _ => None,
            };
            dispatches.push((pipeline, group, grid_at(i)?, second));
        }
        let record =
            |encoder: &mut wgpu::CommandEncoder, step: usize, writes: Option<wgpu::ComputePassTimestampWrites<'_>>| {
                let mut pass =
                    encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: writes });
                let Some(&(pipeline, group, grid, second)) = dispatches.get(step) else {
                    return tail.map_or(Ok(()), |t| t.dispatch_step(&mut pass, step));
                };
                if let Some((x, y)) = grid {
                    pass.set_pipeline(pipeline);
                    pass.set_bind_group(0, group, &[]);
                    pass.dispatch_workgroups(x, y, 1);
                    if let Some((pipeline, group, (x, y))) = second {
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, group, &[]);
                        pass.dispatch_workgroups(x, y, 1);
                    }
                }
                Ok(())
            };
        // Whether step `step` dispatches anything (every optimizer's step does).
        let dispatched = |step: usize| dispatches.get(step).is_none_or(|d| d.2.is_some());
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut seconds = vec![None; steps];
        if gpu.timestamps {
            // Two queries per step, at most `wgpu::QUERY_SET_MAX_QUERIES` per set.
            let per_set = (wgpu::QUERY_SET_MAX_QUERIES / 2) as usize;
            let period = f64::from(gpu.queue.get_timestamp_period()) * 1e-9;
            for first in (0..steps).step_by(per_set) {
                let steps = first..(first + per_set).min(steps);
                let queries = 2 * steps.len() as u32;
                let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("profile"),
                    ty: wgpu::QueryType::Timestamp,
                    count: queries,
                });
                let bytes = u64::from(queries) * wgpu::QUERY_SIZE as u64;
                let resolved =
                    gpu.buffer("timestamps", bytes, wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC)?;
                let staging =
                    gpu.buffer("timestamps", bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
                let mut encoder =
                    gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("profile") });
                for (q, step) in steps.clone().enumerate() {
                    let writes = wgpu::ComputePassTimestampWrites {
                        query_set: &set,
                        beginning_of_pass_write_index: Some(2 * q as u32),
                        end_of_pass_write_index: Some(2 * q as u32 + 1),
                    };
                    record(&mut encoder, step, Some(writes))?;
                }
                encoder.resolve_query_set(&set, 0..queries, &resolved, 0);
                encoder.copy_buffer_to_buffer(&resolved, 0, &staging, 0, bytes);
                gpu.queue.submit([encoder.finish()]);
                let data = gpu.read_staging(std::slice::from_ref(&staging), "timestamps", 2 * queries as usize)?;
                let ticks: Vec<u64> = data.as_chunks::<8>().0.iter().map(|&b| u64::from_le_bytes(b)).collect();
                for (q, step) in steps.enumerate() {
                    if dispatched(step) {
                        seconds[step] = Some(ticks[2 * q + 1].saturating_sub(ticks[2 * q]) as f64 * period);
                    }
                }
            }
        } else {
            for (step, time) in seconds.iter_mut().enumerate() {
                if !dispatched(step) {
                    continue;
                }
                let mut encoder =
                    gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("profile") });
                record(&mut encoder, step, None)?;
                let start = std::time::Instant::now();
                gpu.queue.submit([encoder.finish()]);
                gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Poll(e.to_string()))?;
                *time = Some(start.elapsed().as_secs_f64());
            }
        }
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Rejected { what: "a profiled dispatch", message: e.to_string() });
        }
        gpu.check_lost()?;
        Ok(Profile { clock: if gpu.timestamps { Clock::Device } else { Clock::Host }, seconds })
    }
}
