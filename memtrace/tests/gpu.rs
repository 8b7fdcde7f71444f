//! GPU memory without a GPU: the bundled stand-in for the CUDA driver (`libcuda.so.1`,
//! the same entry points and signatures, fake device addresses) is dlopen'd by a program
//! that allocates every kind in a known pattern, a failing call included, 200 ms after
//! `cuInit`. memtrace must find the driver API when it is mapped, probe it before the
//! first allocation, and count exactly what the program says it did.
mod common;

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    path::Path,
    process::{Command, Stdio},
};

use common::*;
use serde_json::Value;

fn gpu_workload() -> std::path::PathBuf {
    Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("gpu_workload")
}

fn fake_libcuda() -> std::path::PathBuf {
    Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("fake_cuda/libcuda.so.1")
}

const GPU_FIGURES: [&str; 8] =
    ["allocs", "frees", "bytes_req", "bytes_alloc", "live_allocs", "live_bytes_req", "failed", "failed_bytes_req"];

fn figure(v: &Value, name: &str) -> u64 {
    v[name].as_u64().unwrap_or(0)
}

/// Records the workload (with `env` set for memtrace); returns the recording and the
/// workload's manifest.
fn record_workload(name: &str, env: &[(&str, &str)]) -> (std::path::PathBuf, Value) {
    let dir = scratch(name).until_exit();
    let data = dir.join("gpu.data");
    let manifest_path = dir.join("manifest.json");
    run(memtrace()
        .envs(env.iter().copied())
        .args(["record", "-q", "-o"])
        .arg(&data)
        .arg("--")
        .arg(gpu_workload())
        .arg(fake_libcuda())
        .arg(&manifest_path));
    (data, manifest(&manifest_path))
}

fn assert_totals_match(report: &Value, manifest: &Value) {
    let totals = &report["totals"];
    for domain in ["gpu", "gpu_va"] {
        for f in GPU_FIGURES {
            assert_eq!(
                figure(&totals[domain], f),
                figure(&manifest[domain], f),
                "{domain}.{f}: report {:#}, manifest {:#}",
                totals[domain],
                manifest[domain]
            );
        }
        assert_eq!(totals[domain]["unmatched_frees"], 0, "{domain}: {:#}", totals[domain]);
    }
}

#[test]
fn a_running_process_with_the_driver_loaded_is_probed_at_once() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("gpu-pid");
    let data = dir.join("gpu.data");
    let manifest_path = dir.join("manifest.json");
    let mut target = Command::new(gpu_workload())
        .arg(fake_libcuda())
        .arg(&manifest_path)
        .env("GPU_WORKLOAD_WAIT_STDIN", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut target_out = BufReader::new(target.stdout.take().unwrap());
    let mut ready = String::new();
    target_out.read_line(&mut ready).unwrap();
    assert_eq!(ready, "waiting\n", "the driver is loaded and initialised");
    let mut recorder = memtrace()
        .args(["record", "--pid", &target.id().to_string(), "-o"])
        .arg(&data)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = wait_until_tracing(&mut recorder);
    // It allocates 200 ms from now: long before the periodic maps scan (2 s).
    target.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    target_out.read_to_string(&mut rest).unwrap();
    assert!(target.wait().unwrap().success());
    let status = recorder.wait().unwrap();
    assert!(status.success(), "{}", stderr.join().unwrap());
    assert_totals_match(&report_json(&data, &[]), &manifest(&manifest_path));
}

#[test]
fn gpu_probes_attach_one_perf_event_per_probe_too() {
    require_root();
    let _sharing = sharing_the_machine();
    let (data, manifest) = record_workload("gpu-perf", &[("MEMTRACE_UPROBE_ATTACH", "perf")]);
    assert_totals_match(&report_json(&data, &[]), &manifest);
}

#[test]
fn gpu_allocations_of_every_kind_are_counted_exactly() {
    require_root();
    let _sharing = sharing_the_machine();
    let (data, manifest) = record_workload("gpu", &[]);
    let report = report_json(&data, &["--by", "function"]);
    assert_totals_match(&report, &manifest);
    let totals = &report["totals"];
    for domain in ["gpu", "gpu_va"] {
        for f in GPU_FIGURES {
            assert_eq!(
                figure(&totals[domain], f),
                figure(&manifest[domain], f),
                "{domain}.{f}: report {:#}, manifest {:#}",
                totals[domain],
                manifest[domain]
            );
        }
        assert_eq!(totals[domain]["unmatched_frees"], 0, "{domain}: {:#}", totals[domain]);
    }
    // Each function of the program is a GPU site with its own figures, named by its stack.
    let sites = report["sites"].as_array().unwrap();
    for function in [
        "gpu_device",
        "gpu_pitched",
        "gpu_managed",
        "gpu_async",
        "gpu_pool",
        "gpu_host",
        "gpu_virtual",
        "gpu_out_of_memory",
    ] {
        let site = sites
            .iter()
            .find(|s| s["domain"] == "gpu" && s["frames"][0]["function"] == function)
            .unwrap_or_else(|| panic!("no gpu site named {function} in {:#}", report["sites"]));
        let frames = site["frames"].as_array().unwrap();
        assert!(frames.iter().any(|f| f["function"] == "main"), "{function}: {frames:#?}");
    }
    let oom = sites.iter().find(|s| s["frames"][0]["function"] == "gpu_out_of_memory").unwrap();
    assert_eq!(oom["failed"], 1, "{oom:#}");
    assert_eq!(oom["allocs"], 0, "{oom:#}");
    assert_eq!(oom["failed_bytes_req"], 1u64 << 50, "{oom:#}");
    // cuMemCreate names its device in the allocation properties.
    let physical_site = sites.iter().find(|s| s["domain"] == "gpu" && s["frames"][0]["function"] == "gpu_virtual");
    assert_eq!(physical_site.unwrap()["devices"], serde_json::json!([1]), "{physical_site:#?}");
    let pitched = sites.iter().find(|s| s["frames"][0]["function"] == "gpu_pitched").unwrap();
    assert_eq!(pitched["kinds"], serde_json::json!(["pitched"]), "{pitched:#}");
    assert_eq!(pitched["bytes_alloc"], 1024 * 64, "pitch × height: {pitched:#}");
    // --domain gpu keeps only the GPU domains.
    let only = report_json(&data, &["--domain", "gpu"]);
    let names: Vec<&String> = only["totals"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["gpu", "gpu_va"], "{:#}", only["totals"]);
    assert!(only["sites"].as_array().unwrap().iter().all(|s| s["domain"] == "gpu" || s["domain"] == "gpu_va"));
    // --kind physical: the cuMemCreate site only.
    let physical = report_json(&data, &["--kind", "physical", "--by", "function"]);
    let rows = physical["sites"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0]["allocs"], 2);
    assert_eq!(rows[0]["frames"][0]["function"], "gpu_virtual");
    // The text report: GPU rows marked G, the failed call said apart.
    let text = run(memtrace().args(["report", "--domain", "gpu", "--by", "function", "-i"]).arg(&data));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("gpu: 1 call failed (not allocations)"), "{text}");
    assert!(text.lines().any(|l| l.trim_start().starts_with("G ") && l.contains("gpu_device")), "{text}");
}
