//! Tensors on the device: [`DeviceTensor`] (an output kept there, or a key/value cache with
//! room to grow), and how the engine splits a tensor over buffers no larger than
//! [`Gpu::chunk_bytes`], uploads it and reads it back.

use super::cache::CacheCopy;
use super::{Gpu, GpuError};
use kiln_compiler::tensor::Tensor;
use std::sync::Arc;

/// Usage of every tensor buffer: bound as storage, written by the queue, copied from.
pub(crate) const STORAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_DST).union(wgpu::BufferUsages::COPY_SRC);

impl Gpu {
    /// A tensor of `bytes` bytes as chunk buffers.
    pub(super) fn chunked(
        &self,
        what: &str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<Vec<wgpu::Buffer>, GpuError> {
        let n = bytes.div_ceil(self.chunk_bytes).max(1);
        (0..n)
            .map(|c| {
                // At least one element: an empty tensor (a cache with nothing in it) still binds.
                let size = (bytes - c * self.chunk_bytes).min(self.chunk_bytes).max(4);
                let label = if n == 1 { what.to_string() } else { format!("{what} (chunk {c} of {n})") };
                self.buffer(&label, size, usage)
            })
            .collect()
    }

    /// Writes `data` across chunk buffers.
    pub(super) fn write_chunked(&self, buffers: &[wgpu::Buffer], data: &[u8]) {
        for (buffer, part) in buffers.iter().zip(data.chunks(self.chunk_bytes as usize)) {
            self.queue.write_buffer(buffer, 0, part);
        }
    }

    /// Records on `encoder` the copy of a tensor of `bytes` bytes, held in `chunks` as
    /// [`Gpu::chunked`] splits it, into mappable staging buffers split the same way (so no buffer,
    /// staging included, is larger than a chunk), and returns them for [`Gpu::read_staging`].
    pub(super) fn stage(
        &self,
        what: &str,
        chunks: &[wgpu::Buffer],
        bytes: u64,
        encoder: &mut wgpu::CommandEncoder,
    ) -> Result<Vec<wgpu::Buffer>, GpuError> {
        let staging = self.chunked(what, bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
        for (c, (from, to)) in chunks.iter().zip(&staging).enumerate() {
            let len = bytes.saturating_sub(c as u64 * self.chunk_bytes).min(self.chunk_bytes).next_multiple_of(4);
            if len > 0 {
                encoder.copy_buffer_to_buffer(from, 0, to, 0, len);
            }
        }
        Ok(staging)
    }

    /// Waits for the work submitted so far and returns the first `n` 4-byte words held by mappable
    /// staging buffers, one after the other (`what` names them in errors).
    pub(crate) fn read_staging(&self, staging: &[wgpu::Buffer], what: &str, n: usize) -> Result<Vec<u8>, GpuError> {
        let (tx, rx) = std::sync::mpsc::channel();
        for buffer in staging {
            let tx = tx.clone();
            buffer.slice(..).map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        }
        drop(tx);
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Poll(e.to_string()))?;
        self.check_lost()?;
        let failed = |message: String| GpuError::ReadBack { what: what.to_string(), message };
        for _ in staging {
            rx.recv().map_err(|_| failed("the mapping was cancelled".into()))?.map_err(|e| failed(e.to_string()))?;
        }
        let mut data = Vec::with_capacity(4 * n);
        for buffer in staging {
            let want = (4 * n).saturating_sub(data.len());
            {
                let view = buffer.slice(..).get_mapped_range().map_err(|e| failed(e.to_string()))?;
                data.extend_from_slice(view.get(..want.min(view.len())).unwrap_or_default());
            }
            buffer.unmap();
        }
        if data.len() < 4 * n {
            return Err(failed(format!("read {} of {} bytes", data.len(), 4 * n)));
        }
        Ok(data)
    }
}

/// An f32 tensor that lives on the device (see [`GpuModel::run_resident`]), split over buffers
/// as large tensors are. A key/value cache appended in place (see [`GpuModel::run_resident`]) is
/// a `[b, heads, len, d]` tensor in one buffer with room for more rows per head than it holds:
/// its heads lie `room` rows apart, and rows past `len` are not part of it.
///
/// [`GpuModel::run_resident`]: super::GpuModel::run_resident
pub struct DeviceTensor {
    pub(super) gpu: Arc<Gpu>,
    pub(super) shape: Vec<usize>,
    pub(super) buffers: Vec<wgpu::Buffer>,
    /// Rows of room per head (the head stride), when more than the rows it holds.
    pub(super) room: Option<usize>,
}

impl DeviceTensor {
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Rows per head its buffer has room for, if it is a cache with room for more rows than it
    /// holds (see [`DeviceTensor`]).
    pub fn room(&self) -> Option<usize> {
        self.room
    }

    /// `[b * heads, len, d]` of a 4-D tensor, and the rows of room per head.
    pub(super) fn heads(&self) -> Result<(usize, usize, usize, usize), GpuError> {
        let &[b, heads, len, d] = self.shape.as_slice() else {
            return Err(GpuError::CacheShape(self.shape.clone()));
        };
        Ok((b * heads, len, d, self.room.unwrap_or(len)))
    }

    /// Reads it back.
    pub fn read(&self) -> Result<Tensor, GpuError> {
        let gpu = &self.gpu;
        let n = match self.room {
            Some(_) => self.heads().map(|(heads, _, d, room)| heads * room * d)?,
            None => self.shape.iter().product(),
        };
        let bytes = 4 * n as u64;
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("read") });
        let staging = gpu.stage("readback", &self.buffers, bytes, &mut encoder)?;
        gpu.queue.submit([encoder.finish()]);
        let data = gpu.read_staging(&staging, "a device tensor", n)?;
        let data: &[f32] = bytemuck::cast_slice::<u8, f32>(&data);
        let data = match self.room {
            Some(_) => {
                let (heads, len, d, room) = self.heads()?;
                (0..heads).flat_map(|h| data.iter().skip(h * room * d).take(len * d)).copied().collect()
            }
            None => data.to_vec(),
        };
        Ok(Tensor::f32(self.shape.clone(), data))
    }

    /// The latest `rows` rows of a `[b, heads, len, d]` cache (all of it if it holds no more):
    /// what a sliding-window layer keeps. Copied on the device, one range per head.
    pub fn keep_last_rows(self, rows: usize) -> Result<DeviceTensor, GpuError> {
        let (heads, len, d, room) = self.heads()?;
        if len <= rows {
            return Ok(self);
        }
        let gpu = &self.gpu;
        // `[b, heads, rows, d]` (`heads` checked the shape).
        let mut shape = self.shape.clone();
        if let Some(len) = shape.get_mut(2) {
            *len = rows;
        }
        let buffers = gpu.chunked("the key/value cache", 4 * (heads * rows * d) as u64, STORAGE)?;
        let mut encoder = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("slide") });
        let copy = CacheCopy { from: (self.buffers.clone(), room), to: (buffers.clone(), rows), heads, rows, d };
        copy.record(&mut encoder, len - rows, gpu.chunk_bytes)?;
        gpu.queue.submit([encoder.finish()]);
        Ok(DeviceTensor { gpu: self.gpu.clone(), shape, buffers, room: None })
    }
}

/// Records the copy of `len` bytes from byte `from` of a tensor held in `src`'s chunks of
/// `chunk` bytes to byte `to` of one held in `dst`'s, split where either crosses a chunk.
pub(crate) fn copy_range(
    encoder: &mut wgpu::CommandEncoder,
    (src, mut from): (&[wgpu::Buffer], u64),
    (dst, mut to): (&[wgpu::Buffer], u64),
    mut len: u64,
    chunk: u64,
) -> Result<(), GpuError> {
    let out_of_range = || GpuError::Internal("a cache copy runs past its buffers".into());
    while len > 0 {
        let (s, d) = (
            src.get((from / chunk) as usize).ok_or_else(out_of_range)?,
            dst.get((to / chunk) as usize).ok_or_else(out_of_range)?,
        );
        let n = len.min(chunk - from % chunk).min(chunk - to % chunk);
        encoder.copy_buffer_to_buffer(s, from % chunk, d, to % chunk, n);
        (from, to, len) = (from + n, to + n, len - n);
    }
    Ok(())
}
