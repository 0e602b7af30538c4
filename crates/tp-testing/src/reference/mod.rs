//! The float64 reference decoder: [`ops`] (single ops, every rounding and scaling kind),
//! [`block`] (a decoder block over tp-layers' layers), [`model`] (a whole checkpoint folder).

pub mod block;
pub mod model;
pub mod ops;
