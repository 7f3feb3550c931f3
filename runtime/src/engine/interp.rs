//! [`InterpEngine`]: the reference interpreter as an engine, the cache in host memory.

use super::{Engine, GenerateError, Memory, Parked, R, Request, slide, take_presents, windows};
use kiln_compiler::graph::{Graph, InputRole};
use kiln_compiler::interp;
use kiln_compiler::tensor::Tensor;
use std::collections::HashMap;

/// The reference interpreter on a graph with its parameters; the cache in host memory.
pub struct InterpEngine {
    graph: Graph,
    params: HashMap<String, Tensor>,
    cache: HashMap<String, Tensor>,
    windows: HashMap<String, usize>,
}

impl InterpEngine {
    /// An engine running `graph` (a cached decoder step, or an encoder) with `params`.
    pub fn new(graph: Graph, params: HashMap<String, Tensor>) -> InterpEngine {
        let windows = windows(graph.inputs().into_iter().map(|(_, name, role)| (name, role)));
        InterpEngine { graph, params, cache: HashMap::new(), windows }
    }
}

impl Engine for InterpEngine {
    fn id_inputs(&self) -> Vec<String> {
        self.graph
            .inputs()
            .iter()
            .filter(|(_, _, role)| *role == InputRole::Ids)
            .map(|(_, name, _)| name.to_string())
            .collect()
    }

    fn encode(&self, given: &HashMap<String, Tensor>) -> R<Memory> {
        Ok(Memory::host(interp::run(&self.graph, &self.params, given)?.into_iter().collect()))
    }

    fn step(&mut self, request: Request<'_>) -> R<HashMap<String, Tensor>> {
        let Request { mut inputs, links, .. } = request;
        // The cache moves into the inputs (no copy per step), and back on an error.
        inputs.extend(std::mem::take(&mut self.cache));
        let mut outputs: HashMap<String, Tensor> = match interp::run(&self.graph, &self.params, &inputs) {
            Ok(outputs) => outputs.into_iter().collect(),
            Err(e) => {
                for (_, past) in links {
                    if let Some(t) = inputs.remove(past) {
                        self.cache.insert(past.clone(), t);
                    }
                }
                return Err(e.into());
            }
        };
        take_presents(links, &mut outputs, &mut self.cache)?;
        slide(&mut self.cache, &self.windows, keep_last_rows)?;
        Ok(outputs)
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

    fn cache(&self) -> R<HashMap<String, Tensor>> {
        Ok(self.cache.clone())
    }
}

/// The latest `rows` rows of a `[b, heads, len, d]` host tensor.
fn keep_last_rows(t: Tensor, rows: usize) -> R<Tensor> {
    let &[b, heads, len, d] = t.shape.as_slice() else {
        return Err(GenerateError::CacheShape(t.shape));
    };
    if len <= rows {
        return Ok(t);
    }
    let data = t.as_f32().ok_or(GenerateError::NotF32("a cache"))?;
    let kept =
        data.chunks(len * d).flat_map(|head| head.get((len - rows) * d..).unwrap_or_default()).copied().collect();
    Ok(Tensor::f32(vec![b, heads, rows, d], kept))
}
