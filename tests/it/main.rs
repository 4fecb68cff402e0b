//! Integration tests: the real binary, the real model, real sockets.
//!
//! They assert counts, states and orderings, never wall times: this machine is
//! shared and noisy, and speed is measured by benchmarks instead.

mod admission;
mod api;
mod batch;
mod batching;
mod bench;
mod embeddings;
mod flow;
mod front;
mod gateway;
mod harness;
mod hostile;
mod k8s;
mod memory;
mod models;
mod observability;
mod package;
mod prefix;
mod priority;
mod scale_out;
mod sdk;
mod service;
mod startup;
mod threads;
