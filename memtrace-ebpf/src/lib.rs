//! Marker library so `cargo` can resolve this package on the host; the programs live in
//! `main.rs` and are built for `bpfel-unknown-none` by `memtrace/build.rs`.
#![no_std]
