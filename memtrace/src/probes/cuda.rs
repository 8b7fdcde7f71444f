//! GPU memory through the CUDA driver API: finding a module that exports it (by its symbol
//! set, whatever the file is called: `libcuda.so.1`, a stand-in, a driver shim) and
//! attaching the `gpu_*` programs to its allocating and freeing entry points, one attach
//! cookie (the [`Kind`]) per function. Callers look at every executable file a traced
//! process maps, so a `dlopen`ed driver is probed before the program's first allocation.
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
use memtrace_common::Kind;

use super::{Attachment, Probes, uprobe_multi};
use crate::elf::ElfFile;

/// The entry points probed, and the kind each reports.
pub const ENTRY_POINTS: &[(&str, Kind)] = &[
    ("cuMemAlloc_v2", Kind::GpuDevice),
    ("cuMemAllocPitch_v2", Kind::GpuPitched),
    ("cuMemAllocManaged", Kind::GpuManaged),
    ("cuMemAllocAsync", Kind::GpuAsync),
    ("cuMemAllocFromPoolAsync", Kind::GpuPool),
    // The per-thread-default-stream entry points (`--default-stream per-thread` code).
    ("cuMemAllocAsync_ptsz", Kind::GpuAsync),
    ("cuMemAllocFromPoolAsync_ptsz", Kind::GpuPool),
    ("cuMemFreeAsync_ptsz", Kind::GpuFree),
    ("cuMemAllocHost_v2", Kind::GpuHostPinned),
    ("cuMemHostAlloc", Kind::GpuHostPinned),
    ("cuMemCreate", Kind::GpuPhysical),
    ("cuMemAddressReserve", Kind::GpuReserve),
    ("cuMemMap", Kind::GpuMap),
    ("cuMemFree_v2", Kind::GpuFree),
    ("cuMemFreeAsync", Kind::GpuFree),
    ("cuMemFreeHost", Kind::GpuFreeHost),
    ("cuMemRelease", Kind::GpuRelease),
    ("cuMemAddressFree", Kind::GpuAddressFree),
    ("cuMemUnmap", Kind::GpuUnmap),
];

/// What makes a module the CUDA driver API.
const REQUIRED: &[&str] = &["cuInit", "cuMemAlloc_v2", "cuMemFree_v2"];

/// Libraries of caching allocators that hand out GPU memory from segments they keep: the
/// driver-level view shows their segments, not each tensor.
pub const CACHING_ALLOCATORS: &[(&str, &str)] = &[("libc10_cuda", "PyTorch's CUDA caching allocator")];

/// The caching allocator a file is, if any (by file name).
pub fn caching_allocator(path: &Path) -> Option<&'static str> {
    let name = path.file_name()?.to_str()?;
    CACHING_ALLOCATORS.iter().find(|(lib, _)| name.starts_with(lib)).map(|(_, what)| *what)
}

/// A module exporting the CUDA driver API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaModule {
    pub path: PathBuf,
    /// (device, inode).
    pub file_id: (u64, u64),
    /// (file offset, kind, symbol), one per address.
    pub points: Vec<(u64, Kind, &'static str)>,
}

/// The CUDA driver API in `path`, if the file exports it.
pub fn find(path: &Path) -> Option<CudaModule> {
    let elf = ElfFile::open(path).ok()?;
    // Every library a traced process maps comes here, on the thread that drains the rings:
    // a hash lookup turns most away (reading a big library's dynamic symbols took up to
    // 7 ms; PostgreSQL's 40 libraries held its first mappings ~21 ms).
    if REQUIRED.iter().any(|n| elf.dynamic_defines(n) == Some(false)) {
        return None;
    }
    let mut names: Vec<&str> = ENTRY_POINTS.iter().map(|(n, _)| *n).collect();
    names.extend(REQUIRED);
    let offsets = elf.function_offsets(&names).ok()?;
    if !REQUIRED.iter().all(|n| offsets.contains_key(*n)) {
        return None;
    }
    let mut points: Vec<(u64, Kind, &'static str)> = Vec::new();
    for &(name, kind) in ENTRY_POINTS {
        if let Some(f) = offsets.get(name)
            && !points.iter().any(|p| p.0 == f.offset)
        {
            points.push((f.offset, kind, name));
        }
    }
    Some(CudaModule { file_id: super::allocator::file_id(path), path: path.to_path_buf(), points })
}

impl Probes {
    /// Loads (verifies) the GPU programs ahead of any attach, so attaching at a `dlopen`
    /// costs no verification (tens of milliseconds) while the program runs on.
    pub fn load_cuda_programs(&mut self) -> Result<()> {
        let programs: &[&'static str] = if self.attach_path == uprobe_multi::AttachPath::Session {
            &["gpu_session", "gpu_free"]
        } else {
            &["gpu_enter", "gpu_return", "gpu_free"]
        };
        for &program in programs {
            self.uprobe(program)?;
        }
        Ok(())
    }

    /// Attaches the `gpu_*` programs to every entry point of `module`, for one process
    /// (`Some(pid)`) or for every process mapping it (the probes filter by the traced set).
    pub fn attach_cuda(&mut self, module: &CudaModule, pid: Option<u32>) -> Result<()> {
        type Point = (u64, Kind, &'static str);
        let (allocs, frees): (Vec<&Point>, Vec<&Point>) = module.points.iter().partition(|p| !p.1.is_free());
        use uprobe_multi::LinkKind;
        let plan: &[(&'static str, &Vec<&Point>, LinkKind)] = if self.attach_path == uprobe_multi::AttachPath::Session {
            &[("gpu_session", &allocs, LinkKind::Session), ("gpu_free", &frees, LinkKind::Entry)]
        } else {
            &[
                ("gpu_enter", &allocs, LinkKind::Entry),
                ("gpu_return", &allocs, LinkKind::Return),
                ("gpu_free", &frees, LinkKind::Entry),
            ]
        };
        for &(program, points, kind) in plan {
            if points.is_empty() {
                continue;
            }
            if self.attach_path.uses_links() {
                let offsets: Vec<u64> = points.iter().map(|p| p.0).collect();
                let cookies: Vec<u64> = points.iter().map(|p| p.1 as u64).collect();
                let prog = self.uprobe(program)?;
                let fd = prog.fd().with_context(|| format!("program {program} not loaded"))?;
                use std::os::fd::AsFd as _;
                let link = uprobe_multi::attach(
                    fd.as_fd(),
                    &uprobe_multi::MultiSpec { path: &module.path, offsets: &offsets, cookies: &cookies, pid, kind },
                )
                .with_context(|| format!("attaching {program} in {}", module.path.display()))?;
                self.attachments.push(Attachment::UProbeMulti(link));
                continue;
            }
            let scope = match pid.and_then(std::num::NonZeroU32::new) {
                Some(pid) => UProbeScope::OneProcess(pid),
                None => UProbeScope::AllProcesses,
            };
            for &&(offset, kind, name) in points.iter() {
                let id = self
                    .uprobe(program)?
                    .attach(
                        UProbeAttachPoint {
                            location: UProbeAttachLocation::AbsoluteOffset(offset),
                            cookie: Some(kind as u64),
                        },
                        &module.path,
                        scope,
                    )
                    .with_context(|| format!("attaching to {name} in {}", module.path.display()))?;
                self.attachments.push(Attachment::UProbe(program, id));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caching_allocators_are_known_by_file_name() {
        assert_eq!(
            caching_allocator(Path::new("/opt/venv/lib/python3.12/site-packages/torch/lib/libc10_cuda.so")),
            Some("PyTorch's CUDA caching allocator")
        );
        assert_eq!(caching_allocator(Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1")), None);
    }

    #[test]
    fn every_entry_point_reads_its_arguments_as_a_kind_it_knows() {
        for (name, kind) in ENTRY_POINTS {
            assert!(kind.is_gpu(), "{name}");
            let frees = name.contains("Free") || name.contains("Release") || name.contains("Unmap");
            assert_eq!(kind.is_free(), frees, "{name}");
        }
    }

    #[test]
    fn a_file_without_the_driver_api_is_not_it() {
        assert!(find(Path::new("/proc/self/exe")).is_none());
    }
}
