//! The cache appends a cached attention step does in its own kernel (when the plan folds them
//! in, `Options::fold_appends`): the WGSL of the threads past the attention's, shared by the
//! blocked attention kernel ([`super::attention`]) and the plain one ([`super::emit`]).

/// The threads a cached attention that appends to the caches runs past its own (`i >=
/// dim(9u)`): one per element of the two caches after the step (`dim(10u)` elements each, `out1`
/// and `out2`), each the cache's row before the step (`pr` of them, `in1` and `in2`) or this
/// step's key (value) columns `kc..` (`vc..`) of the packed rows `in0`. Appending in place
/// (`room`, `dim(13u)`, not 0: see `dims::appends_in_place`), the outputs hold the `pr` rows
/// already, `room` rows apart, and the threads write only this step's. With `s_len`, `k`, `d`,
/// `kv`, `w`, `pr` and `room` in scope.
pub(super) fn append_copy(kc: usize, vc: usize) -> String {
    let mut s = String::from(
        "let j = i - dim(9u);\nlet n = dim(10u);\nlet e = j % n;\nlet c = e % d;\n\
         let rows = select(k, k - pr, room != 0u);\nlet t = (e / d) % rows + select(0u, pr, room != 0u);\n\
         let bh = e / (d * rows);\nlet row = (bh / kv) * s_len + t - pr;\nlet h = bh % kv;\n\
         let o = (bh * select(k, room, room != 0u) + t) * d + c;\n",
    );
    for (which, past, col) in [("j < n", 1, kc), ("j >= n", 2, vc)] {
        s += &format!(
            "if ({which}) {{\n    if (t < pr) {{ out{past}[o] = in{past}[(bh * pr + t) * d + c]; }} \
             else {{ out{past}[o] = in0[row * w + {col}u + h * d + c]; }}\n}}\n"
        );
    }
    s
}
