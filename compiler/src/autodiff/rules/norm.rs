//! Gradients of the row norms: layer_norm and rms_norm.

use super::Rule;

/// The rules of this topic.
pub fn rules() -> Vec<Rule> {
    vec![]
}
