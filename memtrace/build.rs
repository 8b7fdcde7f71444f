//! Builds the eBPF object (embedded by `src/probes`) with aya-build, and the bundled C
//! workloads the demo, the tests and the benchmarks trace.
use std::{env, path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

/// (source, output name, extra compiler flags)
const WORKLOADS: &[(&str, &str, &[&str])] = &[
    ("workloads/alloc_workload.c", "alloc_workload", &["-fno-omit-frame-pointer"]),
    // Release-build style, as distributions ship: whole stacks need the call-frame information.
    ("workloads/alloc_workload.c", "alloc_workload_nofp", &["-fomit-frame-pointer"]),
    // malloc linked into the executable: memtrace must find the allocator there.
    ("workloads/alloc_workload.c", "alloc_workload_static", &["-fno-omit-frame-pointer", "-static"]),
    // No allocator at all.
    ("workloads/no_malloc.c", "no_malloc", &["-nostdlib", "-static", "-ffreestanding", "-fno-stack-protector"]),
    // A second allocator a workload loads with dlopen.
    ("workloads/bump_alloc.c", "libbump_alloc.so", &["-shared", "-fPIC"]),
    // C++ operator new/delete (built with c++).
    ("workloads/new_workload.cpp", "new_workload", &["-std=c++17", "-fno-omit-frame-pointer"]),
    // A prefixed jemalloc API (xyz_je_*) over libjemalloc.
    ("workloads/je_shim.c", "libxyz_je.so", &["-shared", "-fPIC", "-ljemalloc"]),
    // A stand-in for the CUDA driver (no GPU needed), and a program that dlopens it.
    ("workloads/fake_cuda.c", "fake_cuda/libcuda.so.1", &["-shared", "-fPIC", "-fno-ipa-icf"]),
    ("workloads/gpu_workload.c", "gpu_workload", &["-fno-omit-frame-pointer", "-ldl"]),
];

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest_dir.join("../memtrace-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("non-UTF-8 path")?;
    aya_build::build_ebpf(
        [aya_build::Package { name: "memtrace-ebpf", root_dir: ebpf_dir, ..Default::default() }],
        aya_build::Toolchain::default(),
    )?;

    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".into());
    std::fs::create_dir_all(out_dir.join("fake_cuda"))?;
    for (source, name, flags) in WORKLOADS {
        println!("cargo:rerun-if-changed={source}");
        let compiler = if source.ends_with(".cpp") { cxx.as_str() } else { cc.as_str() };
        let status = Command::new(compiler)
            .args(["-O2", "-g", "-Wall", "-Werror"])
            .args(if source.ends_with(".cpp") { &[][..] } else { &["-fno-builtin"][..] })
            .args(if name.starts_with("alloc_workload") { &["-pthread", "-ldl"][..] } else { &[][..] })
            .arg("-o")
            .arg(out_dir.join(name))
            .arg(manifest_dir.join(source))
            .args(*flags)
            .status()
            .with_context(|| format!("running {compiler} for {source} (install gcc: cargo xtask setup)"))?;
        if !status.success() {
            bail!("{compiler} failed to build {source}");
        }
    }
    println!("cargo:rustc-env=MEMTRACE_WORKLOAD_DIR={}", out_dir.display());
    Ok(())
}
