//! memtrace: a system-wide memory-allocation tracer built on eBPF.
//!
//! The pipeline, in the order data flows: [`probes`] load and attach the eBPF programs and
//! own the per-CPU rings; [`event`] decodes ring records; [`session`] drains the rings,
//! orders events and feeds the [`recording`] writer, with [`unwind`] finishing the user
//! stacks the probes could not walk alone and [`python`] putting the Python frames the probes
//! walked in place of the interpreter's; [`analysis`] pairs allocations with
//! frees and aggregates them per stack; [`symbolize`] turns addresses into names.
//!
//! What users read: [`report`] (analysis of a recording, then text or JSON), [`export`]
//! (folded stacks, SVG, pprof), [`top`] (live model, full-screen and batch views) and
//! [`dump`], and [`serve`] (the always-on agent: Prometheus metrics and pprof over HTTP),
//! sharing [`grouping`] (what a row stands for, filters, labels), [`units`] (how
//! figures read) and [`columns`] (tables that fit the terminal).
/// Hash maps and sets on the event path (stack interning, naming frames): foldhash, fast
/// and seeded per process, instead of std's SipHash, which took a fifth of `record`'s CPU
/// on a heavy Python program.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

pub mod analysis;
pub mod at_start;
pub mod columns;
pub mod dump;
pub mod elf;
pub mod event;
pub mod export;
pub mod grouping;
pub mod lifecycle;
pub mod logging;
pub mod modules;
pub mod naming;
pub mod overhead;
pub mod perf_map;
pub mod probes;
pub mod procfs;
pub mod python;
pub mod recording;
pub mod report;
pub mod serve;
pub mod session;
pub mod sizes;
pub mod stack_ids;
pub mod stack_store;
pub mod stacks;
pub mod symbolize;
pub mod top;
pub mod units;
pub mod unwind;
pub mod wrappers;
