//! Rebuild the eBPF object when bpf-linker changes (it embeds the LLVM that emits BTF).
use which::which;

fn main() {
    let bpf_linker = which("bpf-linker").expect("bpf-linker not found: run `cargo xtask setup`");
    println!("cargo:rerun-if-changed={}", bpf_linker.to_str().unwrap());
}
