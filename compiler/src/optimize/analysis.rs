//! The e-graph analysis: [`KAnalysis`] holds the attribute table, the uses of each class of the
//! input graph and the target's kernel limits, and types every e-class ([`Type`]) with
//! [`infer`], marking the classes computed from parameters alone (`konst`: folded at load time,
//! free at run time); `enode_shape` and `enode_konst` give the same facts of one e-node. [`KGraph`]
//! is the e-graph kiln optimizes.

#![expect(clippy::indexing_slicing, reason = "the analysis indexes the e-graph's own classes and attribute table")]

use super::{Attr, AttrValue, Kl, to_op};
use crate::graph::{Dim, Op, Shape, infer};
use crate::tensor::DType;
use egg::{Analysis, DidMerge, EGraph, Id};
use std::collections::HashMap;

/// Shapes as e-class data, and the attribute table.
#[derive(Debug)]
pub struct KAnalysis {
    /// Attribute values by index.
    pub attrs: Vec<AttrValue>,
    pub(super) index: HashMap<AttrValue, u32>,
    /// Consumers of each class of the input graph (outputs count as one), for rules that only pay
    /// when a value has a single use.
    pub uses: HashMap<Id, usize>,
    /// The widest attention head the target's fused attention takes
    /// ([`crate::target::Target::max_attention_head_dim`]).
    pub max_attention_head_dim: usize,
    /// Whether the target runs attention's backward as one op
    /// ([`crate::target::Target::attention_grad`]).
    pub attention_grad: bool,
    /// How each e-node a rule added was made (see [`Provenance`](super::Provenance)).
    pub provenance: super::Provenance,
    /// Choices a multi-class rule made to be taken together: e-nodes it added, each with the class
    /// it rewrote. They pay only together (one op serving several values), which a tree
    /// extraction cannot see; extraction tries each group as a whole (see `extract::regroup`).
    pub groups: Vec<Vec<(Id, Kl)>>,
}

impl Default for KAnalysis {
    fn default() -> Self {
        let mut a = KAnalysis {
            attrs: Vec::new(),
            index: HashMap::new(),
            uses: HashMap::new(),
            max_attention_head_dim: crate::target::Target::default().max_attention_head_dim,
            attention_grad: crate::target::Target::default().attention_grad,
            provenance: super::Provenance::default(),
            groups: Vec::new(),
        };
        a.intern(AttrValue::Bool(false));
        a.intern(AttrValue::Bool(true));
        a.intern(AttrValue::Window(None));
        a.intern(AttrValue::Scores(crate::graph::ScoreMods::default()));
        a
    }
}

impl KAnalysis {
    /// The attribute of a value, interning it if new.
    pub fn intern(&mut self, v: AttrValue) -> Attr {
        if let Some(&i) = self.index.get(&v) {
            return Attr(i);
        }
        let i = self.attrs.len() as u32;
        self.attrs.push(v.clone());
        self.index.insert(v, i);
        Attr(i)
    }
}

/// What the analysis knows of a tensor class.
#[derive(Clone, Debug, PartialEq)]
pub struct Type {
    /// Shape.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
    /// Computed from parameters alone (folded at load time, free at run time).
    pub konst: bool,
}

/// Type of an e-class: `None` for attribute leaves and `none`.
pub type Data = Option<Type>;

/// The e-graph kiln optimizes.
pub type KGraph = EGraph<Kl, KAnalysis>;

impl Analysis<Kl> for KAnalysis {
    type Data = Data;

    fn make(egraph: &mut KGraph, enode: &Kl, _id: Id) -> Data {
        let (op, operands) = to_op(egraph, enode)?;
        if let Op::Param { .. } | Op::Input { .. } | Op::Positions { .. } = op
            && let Kl::Attr(a) = enode
            && let AttrValue::Leaf(_, shape, dtype) = &egraph.analysis.attrs[a.0 as usize]
        {
            return Some(Type { shape: shape.clone(), dtype: *dtype, konst: matches!(op, Op::Param { .. }) });
        }
        let types: Vec<&Type> = operands.iter().map(|&o| egraph[o].data.as_ref()).collect::<Option<_>>()?;
        let refs: Vec<(&Shape, DType)> = types.iter().map(|t| (&t.shape, t.dtype)).collect();
        let (shape, dtype) = infer(&op, &refs).ok()?;
        let konst =
            !types.is_empty() && types.iter().all(|t| t.konst) && shape.iter().all(|d| matches!(d, Dim::Fixed(_)));
        Some(Type { shape, dtype, konst })
    }

    fn merge(&mut self, a: &mut Data, b: Data) -> DidMerge {
        // Equal classes have equal types; a class is constant if any of its forms is.
        match (a.as_mut(), b) {
            (None, Some(b)) => {
                *a = Some(b);
                DidMerge(true, false)
            }
            (Some(a), Some(b)) => {
                let (was_a, was_b) = (a.konst, b.konst);
                a.konst |= b.konst;
                DidMerge(a.konst != was_a, a.konst != was_b)
            }
            (Some(_), None) => DidMerge(false, true),
            (None, None) => DidMerge(false, false),
        }
    }
}

pub(super) fn enode_shape(egraph: &KGraph, enode: &Kl) -> Option<Shape> {
    let (op, operands) = to_op(egraph, enode)?;
    if let Kl::Attr(a) = enode
        && let AttrValue::Leaf(_, shape, _) = &egraph.analysis.attrs[a.0 as usize]
    {
        return Some(shape.clone());
    }
    let types: Vec<&Type> = operands.iter().map(|&o| egraph[o].data.as_ref()).collect::<Option<_>>()?;
    let refs: Vec<(&Shape, DType)> = types.iter().map(|t| (&t.shape, t.dtype)).collect();
    infer(&op, &refs).ok().map(|(s, _)| s)
}

/// Whether an e-node computes from parameters alone (so it is folded at load time).
pub(super) fn enode_konst(egraph: &KGraph, enode: &Kl) -> bool {
    let Some((op, operands)) = to_op(egraph, enode) else { return false };
    match op {
        Op::Param { .. } => true,
        Op::Input { .. } | Op::Positions { .. } => false,
        _ => !operands.is_empty() && operands.iter().all(|&o| egraph[o].data.as_ref().is_some_and(|t| t.konst)),
    }
}
