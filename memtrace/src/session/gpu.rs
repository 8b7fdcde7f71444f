//! The CUDA driver API, wherever a traced process maps it: each executable file mapped
//! (the mapping tracker's records, within a drain of the `dlopen`; the periodic maps scan
//! as a fallback) is checked once for the driver's symbol set, and the GPU probes attach
//! to it at once, so a program allocating right after `cuInit` is seen.
use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use super::{Target, Tracer, probe_scope};
use crate::{event::FileMapping, probes::cuda, procfs};

/// What the session knows of the CUDA driver modules.
#[derive(Default)]
pub(super) struct GpuState {
    /// Files already checked for the driver API, by path as the process sees it.
    checked: HashSet<PathBuf>,
    /// The modules found.
    modules: Vec<cuda::CudaModule>,
    /// (pid scope, module file) pairs with probes (0: every process).
    attached: HashSet<(u32, (u64, u64))>,
}

impl Tracer {
    /// A traced process mapped code: the CUDA driver API, if the file has it.
    pub(super) fn on_code_mapped(&mut self, m: &FileMapping) {
        let Some(path) = &m.path else { return };
        if self.options.user {
            self.check_cuda(m.pid, Path::new(path));
        }
    }

    /// Every executable file `pid` maps now, checked for the CUDA driver API.
    pub(super) fn check_cuda_mapped(&mut self, pid: u32) {
        let Ok(maps) = procfs::Maps::read(pid) else { return };
        let objects: Vec<PathBuf> = maps.file_mappings().filter(|m| m.executable).map(|m| m.path.clone()).collect();
        for object in objects {
            self.check_cuda(pid, &object);
        }
    }

    /// Checks `object` (a path as process `pid` sees it) for the CUDA driver API once,
    /// and attaches the GPU probes for `pid` if it has it.
    pub(super) fn check_cuda(&mut self, pid: u32, object: &Path) {
        let started = std::time::Instant::now();
        let path = procfs::path_in_process(pid, object);
        let module = if self.gpu.checked.insert(path.clone()) {
            let id = crate::probes::allocator::file_id(&path);
            match self.gpu.modules.iter().find(|m| m.file_id == id) {
                Some(m) => Some(m.clone()),
                None => {
                    let found = cuda::find(&path);
                    if let Some(m) = &found {
                        log::debug!("CUDA driver API in {} ({} entry points)", path.display(), m.points.len());
                        self.gpu.modules.push(m.clone());
                    }
                    found
                }
            }
        } else {
            let id = crate::probes::allocator::file_id(&path);
            self.gpu.modules.iter().find(|m| m.file_id == id).cloned()
        };
        let Some(module) = module else { return };
        let found_us = started.elapsed().as_micros();
        let scope = match self.options.target {
            Target::All => 0,
            _ => probe_scope(&self.probes, &self.options, Some(pid)).unwrap_or(0),
        };
        if !self.gpu.attached.insert((scope, module.file_id)) {
            return;
        }
        match self.probes.attach_cuda(&module, (scope != 0).then_some(scope)) {
            Ok(()) => log::debug!(
                "GPU probes on {} for pid {pid} in {} us ({found_us} us to find them)",
                module.path.display(),
                started.elapsed().as_micros(),
            ),
            Err(e) if !self.options.quiet => {
                eprintln!("memtrace: not tracing GPU memory in {} (pid {pid}): {e:#}", module.path.display())
            }
            Err(_) => {}
        }
    }
}
