//! [`CpuEngine`]: a plan on the CPU's native kernels as an engine, the cache in host memory.

use super::{BatchSeq, Engine, Link, Memory, Parked, R, Request, batch_logits, plan_ids, plan_windows};
use crate::cpu::cache::KvCache;
use crate::cpu::{CpuModel, SeqStep};
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// A compiled plan on the CPU's native kernels; the cache in host memory, read in place and
/// appended in place (see [`crate::cpu::cache`]).
pub struct CpuEngine {
    model: CpuModel,
    cache: KvCache,
    windows: HashMap<String, usize>,
}

impl CpuEngine {
    /// An engine running `model`.
    pub fn new(model: CpuModel) -> CpuEngine {
        let windows = plan_windows(model.plan());
        CpuEngine { model, cache: KvCache::new(), windows }
    }

    /// The cache as it is held: by past input name, each with its length and spare capacity.
    pub fn buffers(&self) -> &KvCache {
        &self.cache
    }
}

impl Engine for CpuEngine {
    fn id_inputs(&self) -> Vec<String> {
        plan_ids(self.model.plan())
    }

    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory> {
        Ok(Memory::host(self.model.run(given)?.into_iter().collect()))
    }

    fn step(&mut self, request: Request<'_>) -> R<HashMap<String, Tensor>> {
        let outputs = self.model.run_cached(&request.inputs, &mut self.cache, request.links)?;
        slide_windows(&self.windows, &mut self.cache)?;
        Ok(outputs.into_iter().collect())
    }

    fn clear(&mut self) {
        self.cache.clear();
    }

    fn park(&mut self) -> Parked {
        Parked::new(std::mem::take(&mut self.cache))
    }

    fn resume(&mut self, parked: Parked) -> R<()> {
        self.cache = parked.take()?;
        Ok(())
    }

    fn step_batch(&mut self, seqs: &mut [BatchSeq<'_>], links: &[Link]) -> R<Option<Vec<Vec<f32>>>> {
        if self.model.batching().is_err() {
            return Ok(None);
        }
        let mut steps = Vec::with_capacity(seqs.len());
        for seq in seqs.iter_mut() {
            let cache = seq.parked.get_mut::<KvCache>()?;
            steps.push(SeqStep { cache, token: seq.token, past: seq.past });
        }
        let outputs = self.model.run_batched(&mut steps, links)?;
        for step in steps {
            slide_windows(&self.windows, step.cache)?;
        }
        batch_logits(outputs, seqs.len()).map(Some)
    }

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        Ok(self.cache.iter().map(|(name, buf)| (name.clone(), buf.to_tensor())).collect())
    }
}

/// Cuts each sliding-window layer's cache in `cache` to its latest rows (`windows`: rows by past
/// input name), in place.
fn slide_windows(windows: &HashMap<String, usize>, cache: &mut KvCache) -> R<()> {
    for (past, &rows) in windows {
        if let Some(buf) = cache.get_mut(past) {
            buf.slide(rows)?;
        }
    }
    Ok(())
}
