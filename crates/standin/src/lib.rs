//! A deterministic OpenAI-compatible model server, so tests, the demo and benchmarks exercise
//! real HTTP calls (and scripted failures) without a real model or its bill.

pub mod model_server;
