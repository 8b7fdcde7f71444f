//! The benchmark's floor: a command run under empty probes at the naive attach points.
use std::ffi::OsString;

use anyhow::{Result, anyhow};

use super::{CommandFailed, spawn};
use crate::probes::{self, CallGraph, Probes};

/// Runs `argv` with empty probes at the naive attach points (the benchmark's floor) and
/// returns its exit code.
pub fn run_baseline(argv: &[OsString], placed: bool, with_return: bool) -> Result<i32> {
    probes::check_privileges()?;
    let program = spawn::resolve_program(&argv[0]).map_err(|e| anyhow!(CommandFailed(e)))?;
    let allocator = probes::allocator::for_executable(&program, "")?;
    let mut probes = Probes::load(&probes::Settings {
        all_processes: false,
        user_stacks: false,
        kernel_stacks: false,
        ring_bytes: 4096,
        follow_children: false,
        sample_bytes: None,
        call_graph: CallGraph::Fp,
        track_mappings: false,
        layout_cache: true,
    })?;
    let mut child = spawn::spawn_paused(argv).map_err(|e| anyhow!(CommandFailed(e)))?;
    if let Err(e) = probes.attach_empty(&allocator, child.pid, placed, with_return) {
        child.abandon();
        return Err(e);
    }
    child.release().map_err(|e| anyhow!(CommandFailed(e)))?;
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(child.pid as i32, &mut status, 0) };
    probes.detach().join();
    Ok(spawn::exit_code(status))
}
