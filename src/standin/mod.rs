//! Stand-in systems (a deterministic model server, …) for tests, the demo and benchmarks.

pub mod model_server;
