//! Owning the eBPF side: checking privileges, loading the embedded object with its
//! configuration (kernel structure offsets from BTF), creating one ring buffer per CPU
//! (installed before anything attaches, so no early event is lost), attaching raw
//! tracepoints, syscall tracepoints and uprobes, keeping the unwinder's maps (address
//! spaces, per-file tables) and reading the probes' counters. Dropping [`Probes`] detaches
//! everything.
//!
//! Over 500 lines: loading, attaching and reading the counters of one eBPF object share its maps and links; multi-uprobe links, BTF and allocator discovery are in their own files.
pub mod allocator;
pub mod btf;
pub mod cuda;
pub mod layout_cache;
mod outer;
pub mod placement;
mod pool;
pub mod ring;
pub mod uprobe_multi;
pub mod verify;

use std::{
    num::NonZeroU32,
    os::fd::{AsFd as _, BorrowedFd},
    thread::JoinHandle,
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, Map, MapData, PerCpuArray,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{
        RawTracePoint, UProbe,
        raw_trace_point::RawTracePointLinkId,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use aya_obj::generated::bpf_map_type::{BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_RINGBUF};
use memtrace_common::{
    FileId, FileTable, KernelLayout, Kind, MAX_CPUS, MappingKey, MappingValue, ProbeConfig, RULE_CACHE_SLOTS,
    SampledKey, counter, traced, unwind_mode,
};

use self::btf::{Btf, BtfError};
use crate::unwind::{
    spaces::SpaceSink,
    store::{InstallResult, TableSink},
    table::Table,
};

pub use self::allocator::{Allocator, AttachPoint};
use self::uprobe_multi::{AttachPath, LinkKind, MultiLink, MultiSpec};

/// The probes' object, built by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace"));

/// How the probes should behave; fixed at load time.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Trace every process (`record -a`) rather than the tgids added with `trace_tgid`.
    pub all_processes: bool,
    pub user_stacks: bool,
    pub kernel_stacks: bool,
    /// Bytes per CPU ring (a power of two, at least a page).
    pub ring_bytes: u32,
    /// Children of traced processes are traced too.
    pub follow_children: bool,
    /// Size-weighted sampling of user allocations (mean bytes between samples).
    pub sample_bytes: Option<u64>,
    pub call_graph: CallGraph,
    /// Report the executable mappings traced processes make (the mapping tracker).
    pub track_mappings: bool,
    /// Keep the kernel layout in the unwind cache's directory (`layout_cache`); off with
    /// `--no-unwind-cache`.
    pub layout_cache: bool,
}

/// Whether Python frames are walked (`--python-frames`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PythonFrames {
    /// In every traced process that runs CPython 3.10 to 3.13.
    #[default]
    On,
    Off,
}

/// How user stacks are walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CallGraph {
    /// With the call-frame information (`.eh_frame`) of every module: whole stacks whether
    /// or not the code keeps frame pointers.
    #[default]
    Dwarf,
    /// By frame pointers (the kernel's walk): cheapest, but stops at code built without them.
    Fp,
    /// Send a copy of every stack for userspace to unwind, as `perf --call-graph dwarf`
    /// does (for comparison; costly).
    #[value(hide = true)]
    Copy,
}

impl CallGraph {
    pub fn name(self) -> &'static str {
        match self {
            Self::Dwarf => "dwarf",
            Self::Fp => "fp",
            Self::Copy => "copy",
        }
    }

    fn mode(self) -> u32 {
        match self {
            Self::Dwarf => unwind_mode::TABLES,
            Self::Fp => unwind_mode::FRAME_POINTERS,
            Self::Copy => unwind_mode::COPY_ALWAYS,
        }
    }
}

/// A CPU's ring.
pub struct Ring {
    pub cpu: u16,
    pub ring: ring::RingReader,
}

/// Sums and per-CPU values of the probes' loss counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub lost_events: u64,
    pub lost_events_per_cpu: Vec<u64>,
    pub lost_stacks: u64,
    pub lost_inflight: u64,
    pub lost_kernel_live: u64,
    pub no_ring: u64,
    pub lost_sampled_live: u64,
    /// User stacks left truncated at a frame without a table (copy budget spent).
    pub unwind_budget: u64,
    /// Walks that met an address space or mapping not known yet (a copy was sent).
    pub unwind_no_mapping: u64,
    /// Walks that met a file whose table was not installed yet (a copy was sent).
    pub unwind_no_table: u64,
    /// Frames the probes walked, and how many found their rule in the per-CPU cache.
    pub unwind_frames: u64,
    pub unwind_cache_hits: u64,
    /// Ranges the probes added to address spaces themselves.
    pub ranges_installed: u64,
    pub unwind_reused: u64,
    /// Walks that went on from an anchor past frames without a table.
    pub unwind_anchored: u64,
    pub unwind_frames_reused: u64,
    /// Kernel stacks taken from an earlier unwind of their path; unwound anyway and found
    /// the same; found different.
    pub kstacks_reused: u64,
    pub kstacks_checked: u64,
    pub kstacks_differed: u64,
    /// User walks another program on their CPU interleaved with (sent with their call site
    /// alone, cut short).
    pub user_walks_interleaved: u64,
    /// Malloc-family returns the probes ran for.
    pub user_returns: u64,
    /// Kernel allocations of traced tasks made for our own map updates, and their bytes.
    pub probe_busy_allocs: u64,
    pub probe_busy_bytes: u64,
    /// mremaps whose old mapping could not be looked up (recorded as memory).
    pub mremaps_unlooked: u64,
}

/// An attachment, so detaching can close them all at once.
enum Attachment {
    UProbe(&'static str, UProbeLinkId),
    UProbeMulti(MultiLink),
    RawTracePoint(&'static str, RawTracePointLinkId),
}

/// The programs attached to the malloc family and the GPU driver (loaded for multi links
/// when the kernel has them), with the second half their return programs tail-call.
const ALLOCATOR_PROGRAMS: [&str; 7] =
    ["alloc_enter", "alloc_return", "free_enter", "gpu_enter", "gpu_return", "gpu_free", "user_finish"];
/// The uprobe session programs that replace the entry and return programs of the malloc
/// family and the GPU driver where the kernel has sessions, and their second half (loaded
/// for session links).
const SESSION_PROGRAMS: [&str; 3] = ["alloc_session", "gpu_session", "user_finish_session"];

/// A libc `mmap`/`munmap` entry point probed: (its file, its offset, the pid it is probed
/// for; 0: every process).
type MappingPoint = ((u64, u64), u64, u32);

pub struct Probes {
    ebpf: Ebpf,
    rings: Vec<Ring>,
    /// The rings' installation in the outer array, until joined.
    rings_installing: RingsInstalling,
    attachments: Vec<Attachment>,
    attach_path: AttachPath,
    /// The libc `mmap`/`munmap` entry points probed, by (file, offset, pid; 0: every
    /// process). Every allocator resolved in a process brings its libc's pair (jemalloc
    /// found at the start, then libc itself once mapped): probed twice, the later probe's
    /// allocator index would win or lose by attach order. The first one keeps them.
    mapping_points: std::collections::HashSet<MappingPoint>,
    /// Whether the probes take user and kernel stacks (their second halves are needed).
    user_stacks: bool,
    kernel_stacks: bool,
    /// The second-half programs installed in their program arrays (`verify`).
    finishes: Vec<&'static str>,
    /// Table maps installed ahead of need ([`pool`]), filled while the programs are
    /// verified; the install thread takes them.
    table_pool: std::sync::Mutex<Option<pool::TablePool>>,
    _logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
}

/// The thread installing the rings (None once joined).
type RingsInstalling = Option<JoinHandle<Result<()>>>;

/// Probes being detached on background threads.
pub struct Detaching {
    threads: Vec<JoinHandle<()>>,
}

impl Detaching {
    /// Closes each link on a thread of its own: a multi-uprobe link or a perf-event
    /// tracepoint waits 70–150 ms for its grace periods, and separate threads overlap them
    /// all (raw tracepoints close at once).
    fn start(links: Vec<(String, Box<dyn FnOnce() + Send>)>) -> Self {
        let threads = links
            .into_iter()
            .map(|(what, close)| {
                std::thread::spawn(move || {
                    let started = std::time::Instant::now();
                    close();
                    log::debug!("{what} detached in {} ms", started.elapsed().as_millis());
                })
            })
            .collect();
        Self { threads }
    }

    /// Waits until every probe is gone.
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Fails with a one-line explanation unless this process may load tracing programs.
pub fn check_privileges() -> Result<()> {
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let has = |cap: u32| effective & (1 << cap) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        return Ok(());
    }
    bail!(
        "memtrace needs root, or the CAP_BPF and CAP_PERFMON capabilities, to load its probes (try: sudo memtrace ...)"
    )
}

fn possible_cpus() -> Result<u32> {
    let n = aya::util::nr_cpus().map_err(|(path, e)| anyhow::anyhow!("reading {path}: {e}"))?;
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    if n > MAX_CPUS {
        bail!("this machine has {n} possible CPUs; memtrace supports up to {MAX_CPUS}");
    }
    Ok(n)
}

/// Tests only: `MEMTRACE_TEST_INTERLEAVE=N` takes every N-th claim of a CPU's scratch from
/// the user walk that made it before its check, and the claim after each of those after it
/// (while a new stack's record is built), as another program running on the CPU meanwhile
/// would (`ProbeConfig::test_interleave`); 0 (unset): never.
fn test_interleave() -> u32 {
    let every = std::env::var("MEMTRACE_TEST_INTERLEAVE").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    if every != 0 {
        log::warn!("MEMTRACE_TEST_INTERLEAVE={every}: one user walk in {every} is cut at its call site (a test)");
    }
    every
}

/// Whether the probes take a repeat kernel stack from its earlier unwind (the default), or
/// unwind every one (`MEMTRACE_KERNEL_STACK_REUSE=off`, to compare).
fn kernel_stack_reuse() -> bool {
    let off = std::env::var("MEMTRACE_KERNEL_STACK_REUSE").is_ok_and(|v| matches!(v.trim(), "off" | "0" | "no"));
    log::debug!("kernel stacks: {}", if off { "every one unwound" } else { "a repeat taken from its earlier unwind" });
    !off
}

impl Probes {
    /// Loads the programs and installs the rings. Nothing is attached yet.
    pub fn load(settings: &Settings) -> Result<Self> {
        check_privileges()?;
        // The kernel's BTF, for the offsets the probes take from it, unless the cache holds
        // them for this boot (aya's loader reads it only for objects with CO-RE
        // relocations, which this one has none of).
        let started = std::time::Instant::now();
        let kernel =
            layout_cache::layout_or(settings.layout_cache, || Btf::vmlinux().and_then(|btf| kernel_layout(&btf)))?;
        log::debug!("kernel layout read in {} ms", started.elapsed().as_millis());
        let mut loader = EbpfLoader::new();
        let config = ProbeConfig {
            self_tgid: std::process::id(),
            trace_all: u32::from(settings.all_processes),
            user_stacks: u32::from(settings.user_stacks),
            kernel_stacks: u32::from(settings.kernel_stacks),
            unwind_mode: settings.call_graph.mode(),
            wakeup_bytes: settings.ring_bytes / 4,
            track_kernel_live: u32::from(!settings.all_processes),
            follow_children: u32::from(settings.follow_children),
            track_mappings: u32::from(settings.track_mappings),
            cpus: possible_cpus()?,
            kernel_stack_reuse: u32::from(kernel_stack_reuse()),
            test_interleave: test_interleave(),
            _pad: 0,
            kernel,
            sample_bytes: settings.sample_bytes.unwrap_or(0),
        };
        // Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK.
        let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
        // SAFETY: a valid rlimit struct is passed; failure is harmless on newer kernels.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };
        // Sized at load: the rule cache for the CPUs there are; the sampled blocks' map only
        // when sampling (a preallocated hash map of 256k entries is ~9 ms of every start).
        loader.map_max_entries("RULE_CACHE", RULE_CACHE_SLOTS * config.cpus);
        // Each CPU's scratch space and last walks, by the CPU's index (plain arrays: a
        // per-CPU value is at most 32 KiB).
        loader.map_max_entries("SCRATCH", config.cpus);
        loader.map_max_entries("ANCHORS", config.cpus);
        // The threads' in-flight allocator calls are task storage, which aya creates but
        // has no type for (the probes alone use it).
        loader.allow_unsupported_maps();
        let mut ebpf = loader.override_global("CONFIG", &config, true).load(OBJECT).map_err(|e| {
            anyhow::anyhow!("loading the eBPF programs: {e} (is BTF available at /sys/kernel/btf/vmlinux?)")
        })?;
        log::debug!("maps created in {} ms", started.elapsed().as_millis());
        let logger = aya_log::EbpfLogger::init(&mut ebpf).ok();
        let (rings, rings_installing) = install_rings(&mut ebpf, settings.ring_bytes)?;
        let attach_path = AttachPath::choose();
        log::debug!("uprobes attach through {}", attach_path.name());
        let mut probes = Self {
            ebpf,
            rings,
            rings_installing,
            attachments: Vec::new(),
            attach_path,
            mapping_points: Default::default(),
            user_stacks: settings.user_stacks,
            kernel_stacks: settings.kernel_stacks,
            finishes: Vec::new(),
            table_pool: std::sync::Mutex::new(None),
            _logger: logger,
        };
        if settings.call_graph == CallGraph::Dwarf && (settings.user_stacks || settings.kernel_stacks) {
            match probes.pool() {
                Ok(pool) => probes.table_pool = std::sync::Mutex::new(Some(pool)),
                Err(e) => log::debug!("unwind tables go into maps of their own: {e:#}"),
            }
        }
        Ok(probes)
    }

    /// Waits until every ring is in the outer array: a program attached before would find
    /// no ring for its CPU and lose its records.
    pub(super) fn rings_installed(&mut self) -> Result<()> {
        match self.rings_installing.take() {
            Some(thread) => thread.join().map_err(|_| anyhow::anyhow!("installing the ring buffers panicked"))?,
            None => Ok(()),
        }
    }

    /// How this session attaches its uprobes.
    pub fn attach_path(&self) -> AttachPath {
        self.attach_path
    }

    pub fn rings_mut(&mut self) -> &mut [Ring] {
        &mut self.rings
    }

    /// Records that ran across the end of their ring (copied to be read whole).
    pub fn ring_records_joined(&self) -> u64 {
        self.rings.iter().map(|r| r.ring.joined_records).sum()
    }

    /// Unmaps the rings once they were read dry for the last time (their pages were part
    /// of the resident set).
    pub fn unmap_rings(&mut self) {
        self.rings = Vec::new();
    }

    /// Adds `tgid` to the traced set; a process memtrace forked waits for its exec first.
    pub fn trace_tgid(&mut self, tgid: u32, pending_exec: bool) -> Result<()> {
        let mut map: HashMap<_, u32, u32> = HashMap::try_from(self.ebpf.map_mut("TRACED").context("TRACED map")?)?;
        let state = if pending_exec { traced::PENDING_EXEC } else { traced::ACTIVE };
        map.insert(tgid, state, 0).context("adding the target to the traced set")?;
        // After the set: threads' kept answers (`inflight::traced_thread`) are looked up again.
        self.bump_generation("TRACED_GEN")
    }

    /// Changes the generation word `name` after a change of the maps it stands for: the
    /// probes' remembered answers from them are looked up again.
    fn bump_generation(&mut self, name: &str) -> Result<()> {
        let mut generation: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut(name).with_context(|| format!("{name} map"))?)?;
        let next = generation.get(&0, 0).with_context(|| format!("reading {name}"))?.wrapping_add(1);
        generation.set(0, next, 0).with_context(|| format!("writing {name}"))?;
        Ok(())
    }

    /// The tgids currently in the traced set (the targets and, with follow, their children).
    pub fn traced_tgids(&self) -> Result<Vec<u32>> {
        let map: HashMap<_, u32, u32> = HashMap::try_from(self.ebpf.map("TRACED").context("TRACED map")?)?;
        Ok(map.keys().filter_map(Result::ok).collect())
    }

    fn attach_raw_tracepoint(&mut self, program: &'static str) -> Result<()> {
        self.verify(&[program])?;
        let prog: &mut RawTracePoint =
            self.ebpf.program_mut(program).with_context(|| format!("program {program} missing"))?.try_into()?;
        let id = prog.attach(program).with_context(|| format!("attaching to the raw tracepoint {program}"))?;
        self.attachments.push(Attachment::RawTracePoint(program, id));
        Ok(())
    }

    /// Task lifecycle: always on (they drive pairing, process names and address spaces).
    pub fn attach_task_tracepoints(&mut self) -> Result<()> {
        for name in verify::TASK_PROGRAMS {
            self.attach_raw_tracepoint(name)?;
        }
        Ok(())
    }

    /// What the unwinder learns address spaces from after an exec: `openat` and `mmap`
    /// with `PROT_EXEC` (how ld.so and dlopen load libraries, and where JIT code goes).
    pub fn attach_mapping_tracker(&mut self) -> Result<()> {
        for name in verify::MAPPING_PROGRAMS {
            self.attach_raw_tracepoint(name)?;
        }
        Ok(())
    }

    /// The kmem raw tracepoints (after the second half of their allocation programs).
    pub fn attach_kernel(&mut self) -> Result<()> {
        if self.kernel_stacks {
            if self.user_stacks {
                self.install_finish(verify::KERNEL_USER)?;
            }
            self.install_finish(verify::KERNEL_FINISH)?;
        }
        for name in verify::KERNEL_PROGRAMS {
            self.attach_raw_tracepoint(name)?;
        }
        Ok(())
    }

    /// Uprobe program `name`, verified (a return program's second half installed first).
    fn uprobe(&mut self, name: &'static str) -> Result<&mut UProbe> {
        if self.user_stacks && matches!(name, "alloc_return" | "gpu_return") {
            self.install_finish(verify::USER_FINISH)?;
        }
        if self.user_stacks && matches!(name, "alloc_session" | "gpu_session") {
            self.install_finish(verify::SESSION_FINISH)?;
        }
        self.verify(&[name])?;
        self.uprobe_program(name)
    }

    fn uprobe_program(&mut self, name: &str) -> Result<&mut UProbe> {
        Ok(self.ebpf.program_mut(name).with_context(|| format!("program {name} missing"))?.try_into()?)
    }

    /// Attaches the malloc-family probes at every point of `allocator`, for one process
    /// (`Some(pid)`, its threads included) or for every process mapping the object.
    /// All or nothing: when one of the allocator's links fails, those made before it are
    /// closed again (an allocating function probed without its free would report every
    /// block as leaked) and its `mmap`/`munmap` points are no longer marked probed.
    pub fn attach_allocator(&mut self, allocator: &Allocator, pid: Option<u32>) -> Result<()> {
        let before = self.attachments.len();
        let (allocator, marked) = self.without_probed_mappings(allocator, pid.unwrap_or(0));
        let attached = match self.attach_path {
            AttachPath::Session | AttachPath::Multi => self.attach_allocator_multi(&allocator, pid),
            AttachPath::PerfEvents => self.attach_allocator_per_probe(&allocator, pid),
        };
        if attached.is_err() {
            for point in marked {
                self.mapping_points.remove(&point);
            }
            let made: Vec<Attachment> = self.attachments.drain(before..).collect();
            for attachment in made {
                self.close(attachment);
            }
        }
        attached
    }

    /// Closes one link now (for an attach undone; `detach` closes the others in parallel).
    fn close(&mut self, attachment: Attachment) {
        match attachment {
            Attachment::UProbeMulti(link) => drop(link),
            Attachment::UProbe(name, id) => {
                if let Ok(program) = self.uprobe_program(name) {
                    let _ = program.detach(id);
                }
            }
            Attachment::RawTracePoint(name, id) => {
                let prog: Option<&mut RawTracePoint> = self.ebpf.program_mut(name).and_then(|p| p.try_into().ok());
                if let Some(p) = prog {
                    let _ = p.detach(id);
                }
            }
        }
    }

    /// `allocator` less the `mmap`/`munmap`/`mremap` points already probed for `pid` (or for every
    /// process), and those it marked probed.
    fn without_probed_mappings(&mut self, allocator: &Allocator, pid: u32) -> (Allocator, Vec<MappingPoint>) {
        let mut kept = allocator.clone();
        let mut marked = Vec::new();
        kept.points.retain(|p| {
            if !matches!(p.kind, Kind::Mmap | Kind::Munmap | Kind::Mremap) {
                return true;
            }
            let key = (allocator::file_id(&p.path), p.offset + p.probe_offset, pid);
            if self.mapping_points.contains(&(key.0, key.1, 0)) || !self.mapping_points.insert(key) {
                return false;
            }
            marked.push(key);
            true
        });
        (kept, marked)
    }

    /// One link per program and file: the entry and return programs at every allocating
    /// function, the free program at every freeing one; or the session program at both
    /// (it tells a free by its cookie's kind).
    fn attach_allocator_multi(&mut self, allocator: &Allocator, pid: Option<u32>) -> Result<()> {
        let flags = cookie_flags(allocator);
        let mut by_file: std::collections::BTreeMap<&std::path::Path, [Vec<(u64, u64)>; 2]> = Default::default();
        for point in &allocator.points {
            let frees = usize::from(matches!(point.kind, Kind::Free | Kind::Munmap));
            by_file.entry(&point.path).or_default()[frees]
                .push((point.offset + point.probe_offset, point.kind as u64 | flags));
        }
        if self.attach_path == AttachPath::Session {
            for points in by_file.values_mut() {
                let frees = std::mem::take(&mut points[1]);
                points[0].extend(frees);
            }
        }
        let links: &[(&'static str, usize, LinkKind)] = if self.attach_path == AttachPath::Session {
            &[("alloc_session", 0, LinkKind::Session)]
        } else {
            &[
                ("alloc_enter", 0, LinkKind::Entry),
                ("alloc_return", 0, LinkKind::Return),
                ("free_enter", 1, LinkKind::Entry),
            ]
        };
        for (path, points_by) in by_file {
            for &(program, which, kind) in links {
                let points = &points_by[which];
                if points.is_empty() {
                    continue;
                }
                let (offsets, cookies): (Vec<u64>, Vec<u64>) = points.iter().copied().unzip();
                let prog = self.uprobe(program)?;
                let fd = prog.fd().with_context(|| format!("program {program} not loaded"))?;
                let link = uprobe_multi::attach(
                    fd.as_fd(),
                    &MultiSpec { path, offsets: &offsets, cookies: &cookies, pid, kind },
                )
                .with_context(|| format!("attaching {program} to {} functions in {}", offsets.len(), path.display()))?;
                self.attachments.push(Attachment::UProbeMulti(link));
            }
        }
        Ok(())
    }

    fn attach_allocator_per_probe(&mut self, allocator: &Allocator, pid: Option<u32>) -> Result<()> {
        let scope = match pid.and_then(NonZeroU32::new) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        for point in &allocator.points {
            let programs: &[&'static str] = if matches!(point.kind, Kind::Free | Kind::Munmap) {
                &["free_enter"]
            } else {
                &["alloc_enter", "alloc_return"]
            };
            for &program in programs {
                let id = self
                    .uprobe(program)?
                    .attach(
                        UProbeAttachPoint {
                            location: UProbeAttachLocation::AbsoluteOffset(point.offset + point.probe_offset),
                            cookie: Some(point.kind as u64 | cookie_flags(allocator)),
                        },
                        &point.path,
                        scope,
                    )
                    .with_context(|| format!("attaching to {} in {}", point.symbols.join("/"), point.path.display()))?;
                self.attachments.push(Attachment::UProbe(program, id));
            }
        }
        Ok(())
    }

    /// Tells the probes how to walk the Python frames of process `pid` (None: it runs no
    /// interpreter they can walk).
    pub fn set_python(&mut self, pid: u32, info: Option<&memtrace_common::python::PyProcInfo>) -> Result<()> {
        let mut map: aya::maps::HashMap<_, u32, memtrace_common::python::PyProcInfo> =
            aya::maps::HashMap::try_from(self.ebpf.map_mut("PY_PROCS").context("PY_PROCS map")?)?;
        match info {
            Some(info) => map.insert(pid, *info, 0)?,
            None => {
                let _ = map.remove(&pid);
            }
        }
        self.bump_generation("PROC_GEN")
    }

    /// Forgets keys of shared Python frames (their process exec'd or exited): their stacks'
    /// frames are sent again should the keys come back.
    pub fn forget_python_keys(&mut self, keys: &[u64]) -> Result<()> {
        let mut map: aya::maps::HashMap<_, u64, u8> =
            aya::maps::HashMap::try_from(self.ebpf.map_mut("PY_SENT").context("PY_SENT map")?)?;
        for key in keys {
            let _ = map.remove(key);
        }
        Ok(())
    }

    /// Switches size-weighted sampling on (mean bytes between samples) or off (0) while
    /// running: the way out when the rings overflow.
    pub fn set_sampling(&mut self, mean: u64) -> Result<()> {
        let mut map: aya::maps::Array<_, u64> =
            aya::maps::Array::try_from(self.ebpf.map_mut("SAMPLE_OVERRIDE").context("SAMPLE_OVERRIDE map")?)?;
        map.set(0, mean, 0)?;
        Ok(())
    }

    /// The overload switch's second phase: `blocks` (pid, address), live when sampling was
    /// switched on, go into the probes' set of sampled blocks, and from then on only the
    /// frees of blocks in that set are sent. Returns how many did not fit.
    pub fn filter_frees(&mut self, blocks: impl Iterator<Item = (u32, u64)>) -> Result<u64> {
        let mut live: aya::maps::HashMap<_, SampledKey, u8> =
            aya::maps::HashMap::try_from(self.ebpf.map_mut("SAMPLED_LIVE").context("SAMPLED_LIVE map")?)?;
        let mut failed = 0;
        for (tgid, ptr) in blocks {
            if live.insert(SampledKey { tgid, _pad: 0, ptr }, 1, 0).is_err() {
                failed += 1;
            }
        }
        let mut map: aya::maps::Array<_, u64> =
            aya::maps::Array::try_from(self.ebpf.map_mut("SAMPLE_OVERRIDE").context("SAMPLE_OVERRIDE map")?)?;
        map.set(1, 1, 0)?;
        Ok(failed)
    }

    /// The benchmark baseline: empty programs at the naive attach points (malloc entry and
    /// return, free entry), at the function entries or where memtrace would place them.
    pub fn attach_empty(&mut self, allocator: &Allocator, pid: u32, placed: bool, with_return: bool) -> Result<()> {
        let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).context("pid 0")?);
        for point in allocator.points.iter().filter(|p| matches!(p.kind, Kind::Malloc | Kind::Free)) {
            let offset = point.offset + if placed { point.probe_offset } else { 0 };
            let programs: &[&'static str] = if point.kind == Kind::Free || !with_return {
                &["empty_enter"]
            } else {
                &["empty_enter", "empty_return"]
            };
            for &program in programs {
                let id =
                    self.uprobe(program)?.attach(UProbeAttachLocation::AbsoluteOffset(offset), &point.path, scope)?;
                self.attachments.push(Attachment::UProbe(program, id));
            }
        }
        Ok(())
    }

    /// Starts detaching every probe on background threads and returns a handle to join;
    /// the maps and rings stay readable. The kernel waits for an RCU grace period per link
    /// it closes, so links are closed on parallel threads where the grace periods overlap
    /// (a multi link holds many probes and costs one); the caller finishes its work
    /// meanwhile.
    pub fn detach(&mut self) -> Detaching {
        let mut links: Vec<(String, Box<dyn FnOnce() + Send>)> = Vec::new();
        let attachments = std::mem::take(&mut self.attachments);
        for attachment in attachments {
            match attachment {
                Attachment::UProbeMulti(link) => {
                    links.push(("a multi-uprobe link".into(), Box::new(move || drop(link))))
                }
                Attachment::UProbe(name, id) => {
                    if let Some(link) = self.uprobe_program(name).ok().and_then(|p| p.take_link(id).ok()) {
                        links.push((format!("uprobe {name}"), Box::new(move || drop(link))));
                    }
                }
                Attachment::RawTracePoint(name, id) => {
                    let prog: Option<&mut RawTracePoint> = self.ebpf.program_mut(name).and_then(|p| p.try_into().ok());
                    if let Some(link) = prog.and_then(|p| p.take_link(id).ok()) {
                        links.push((format!("raw tracepoint {name}"), Box::new(move || drop(link))));
                    }
                }
            }
        }
        Detaching::start(links)
    }

    /// Events lost so far, on every CPU: one map read (for checks between batches).
    pub fn lost_events(&self) -> Result<u64> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(self.ebpf.map("COUNTERS").context("COUNTERS map")?)?;
        Ok(map.get(&counter::LOST_EVENTS, 0)?.iter().sum())
    }

    pub fn counters(&self) -> Result<Counters> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(self.ebpf.map("COUNTERS").context("COUNTERS map")?)?;
        let per_cpu = |i: u32| -> Result<Vec<u64>> { Ok(map.get(&i, 0)?.iter().copied().collect()) };
        let sum = |i: u32| -> Result<u64> { Ok(per_cpu(i)?.iter().sum()) };
        let lost_events_per_cpu = per_cpu(counter::LOST_EVENTS)?;
        Ok(Counters {
            lost_events: lost_events_per_cpu.iter().sum(),
            lost_events_per_cpu,
            lost_stacks: sum(counter::LOST_STACKS)?,
            lost_inflight: sum(counter::LOST_INFLIGHT)?,
            lost_kernel_live: sum(counter::LOST_KERNEL_LIVE)?,
            no_ring: sum(counter::NO_RING)?,
            lost_sampled_live: sum(counter::LOST_SAMPLED_LIVE)?,
            unwind_budget: sum(counter::UNWIND_BUDGET)?,
            unwind_no_mapping: sum(counter::UNWIND_NO_MAPPING)?,
            unwind_no_table: sum(counter::UNWIND_NO_TABLE)?,
            unwind_frames: sum(counter::UNWIND_FRAMES)?,
            unwind_cache_hits: sum(counter::UNWIND_CACHE_HITS)?,
            ranges_installed: sum(counter::RANGES_INSTALLED)?,
            unwind_reused: sum(counter::UNWIND_REUSED)?,
            unwind_anchored: sum(counter::UNWIND_ANCHORED)?,
            unwind_frames_reused: sum(counter::UNWIND_FRAMES_REUSED)?,
            kstacks_reused: sum(counter::KSTACKS_REUSED)?,
            kstacks_checked: sum(counter::KSTACKS_CHECKED)?,
            kstacks_differed: sum(counter::KSTACKS_DIFFERED)?,
            user_walks_interleaved: sum(counter::USER_WALKS_INTERLEAVED)?,
            user_returns: sum(counter::USER_RETURNS)?,
            probe_busy_allocs: sum(counter::PROBE_BUSY_ALLOCS)?,
            probe_busy_bytes: sum(counter::PROBE_BUSY_BYTES)?,
            mremaps_unlooked: sum(counter::MREMAP_UNLOOKED)?,
        })
    }
}

/// The attach cookie's bits above the kind: glibc (read chunk headers) and the allocator's
/// index, which its records carry.
fn cookie_flags(allocator: &Allocator) -> u64 {
    let glibc = if allocator.glibc { memtrace_common::cookie::GLIBC } else { 0 };
    let mimalloc = if allocator.mimalloc_pages { memtrace_common::cookie::MIMALLOC } else { 0 };
    glibc | mimalloc | u64::from(allocator.index) << memtrace_common::cookie::ALLOCATOR_SHIFT
}

/// The offsets of the kernel fields the probes read, from the kernel's BTF; an error
/// naming what is missing.
fn kernel_layout(btf: &Btf) -> Result<KernelLayout> {
    let f = |strukt: &str, field: &str| -> Result<u32> { Ok(btf.field(strukt, field)?.offset) };
    for (tp, args) in [("kmalloc", 6), ("kmem_cache_alloc", 5), ("kfree", 2), ("mm_page_alloc", 4), ("task_newtask", 2)]
    {
        let found = btf.tracepoint_args(tp);
        if found.is_some_and(|n| n != args) {
            bail!(
                "the kernel's {tp} tracepoint takes {} arguments, not {args}: this kernel is not supported",
                found.unwrap_or(0)
            );
        }
    }
    Ok(KernelLayout {
        task_pid: f("task_struct", "pid")?,
        task_tgid: f("task_struct", "tgid")?,
        task_fsbase: f("task_struct", "thread.fsbase")?,
        task_mm: f("task_struct", "mm")?,
        binprm_filename: f("linux_binprm", "filename")?,
        mm_start_code: f("mm_struct", "start_code")?,
        mm_end_code: f("mm_struct", "end_code")?,
        mm_saved_auxv: f("mm_struct", "saved_auxv")?,
        cache_name: f("kmem_cache", "name")?,
        cache_object_size: f("kmem_cache", "object_size")?,
        cache_size: f("kmem_cache", "size")?,
        exit_has_group_dead: u32::from(btf.tracepoint_args("sched_process_exit") == Some(2)),
        task_files: f("task_struct", "files")?,
        files_fdt: f("files_struct", "fdt")?,
        fdtable_fd: f("fdtable", "fd")?,
        file_inode: f("file", "f_inode")?,
        inode_ino: f("inode", "i_ino")?,
        inode_sb: f("inode", "i_sb")?,
        sb_dev: f("super_block", "s_dev")?,
        binprm_file: f("linux_binprm", "file")?,
        task_nvcsw: f("task_struct", "nvcsw")?,
        task_nivcsw: f("task_struct", "nivcsw")?,
        task_stack: f("task_struct", "stack")?,
        task_utask: f("task_struct", "utask")?,
        utask_return_instances: f("uprobe_task", "return_instances")?,
        ri_stack: f("return_instance", "stack")?,
        ri_orig_ret_vaddr: f("return_instance", "orig_ret_vaddr")?,
        ri_next: f("return_instance", "next")?,
        vma_flags: f("vm_area_struct", "vm_flags")?,
        vma_file: f("vm_area_struct", "vm_file")?,
        ..path_layout(btf)
    })
}

/// The fields a file's absolute path is walked up through (`dentry_parent` 0: none, when
/// the kernel's BTF lacks one: names exec and `openat` were given stay as they were).
fn path_layout(btf: &Btf) -> KernelLayout {
    let f = |strukt: &str, field: &str| btf.field(strukt, field).map(|f| f.offset);
    let walk = || -> Result<KernelLayout, BtfError> {
        Ok(KernelLayout {
            file_path_mnt: f("file", "f_path.mnt")?,
            file_path_dentry: f("file", "f_path.dentry")?,
            dentry_parent: f("dentry", "d_parent")?,
            dentry_name: f("dentry", "d_name.name")?,
            vfsmount_root: f("vfsmount", "mnt_root")?,
            mount_mnt: f("mount", "mnt")?,
            mount_parent: f("mount", "mnt_parent")?,
            mount_mountpoint: f("mount", "mnt_mountpoint")?,
            dentry_hash_pprev: f("dentry", "d_hash.pprev")?,
            ..KernelLayout::default()
        })
    };
    walk().unwrap_or_else(|e| {
        log::debug!("relative names of exec'd and opened files stay relative: {e}");
        KernelLayout::default()
    })
}

/// The smallest table read back from its map rather than kept ([`read_back_fd`]).
const READ_BACK_BYTES: usize = 64 << 10;

/// `BPF_F_INNER_MAP | BPF_F_MMAPABLE`, as the tables array's template has them.
const TABLE_FLAGS: u32 = (1 << 12) | (1 << 10);
/// `BPF_NOEXIST`.
const NOEXIST: u64 = 1;

/// A table's own map, filled.
fn table_map(slot: u32, table: &Table) -> Result<MapData> {
    let n = u32::try_from(table.element_count().max(1)).context("a table too large")?;
    let obj = aya_obj::Map::new_from_params(BPF_MAP_TYPE_ARRAY as u32, 4, 8, n, TABLE_FLAGS);
    let data = MapData::create(obj, &format!("memtrace_uw{slot}"), None)
        .with_context(|| format!("creating an unwind table of {n} entries"))?;
    write_mmapped(&data, table).context("filling an unwind table")?;
    Ok(data)
}

impl TableSink for Probes {
    fn install_tables(&mut self, tables: &[(u32, &Table)]) -> Vec<InstallResult> {
        match outer_fd(&self.ebpf, "TABLES") {
            Ok(outer) => install_tables(outer.as_fd(), tables),
            Err(e) => tables.iter().map(|_| Err(anyhow::anyhow!("{e:#}"))).collect(),
        }
    }

    /// The install thread's maps, with maps installed ahead of need for the tables that
    /// fit them ([`pool`]).
    fn installer(&self) -> Option<crate::unwind::store::Installer> {
        let mut maps = self.table_maps().ok()?;
        maps.pool = self.table_pool.lock().ok().and_then(|mut p| p.take());
        Some(Box::new(maps))
    }

    fn register_file(&mut self, id: FileId, table: FileTable) -> Result<()> {
        let mut map: HashMap<_, FileId, FileTable> =
            HashMap::try_from(self.ebpf.map_mut("FILE_TABLES").context("FILE_TABLES map")?)?;
        map.insert(id, table, 0).context("registering a file's unwind table")?;
        Ok(())
    }
}

/// The unwind tables' maps, on descriptors of their own: tables are installed through them
/// on one thread while another verifies the programs ([`Probes::table_maps`]).
pub struct TableMaps {
    tables: std::os::fd::OwnedFd,
    file_tables: HashMap<MapData, FileId, FileTable>,
    pool: Option<pool::TablePool>,
}

impl TableSink for TableMaps {
    fn install_tables(&mut self, tables: &[(u32, &Table)]) -> Vec<InstallResult> {
        install_tables(self.tables.as_fd(), tables)
    }

    fn place_table(&mut self, slot: u32, table: &Table) -> Option<InstallResult> {
        self.pool.as_mut()?.place(slot, table)
    }

    fn register_file(&mut self, id: FileId, table: FileTable) -> Result<()> {
        self.file_tables.insert(id, table, 0).context("registering a file's unwind table")?;
        Ok(())
    }
}

impl Probes {
    /// The unwind tables' maps, apart from the programs (see [`TableMaps`]).
    pub fn table_maps(&self) -> Result<TableMaps> {
        let file_tables = match self.ebpf.map("FILE_TABLES").context("FILE_TABLES map")? {
            Map::HashMap(data) => {
                let fd = data.fd().as_fd().try_clone_to_owned().context("duplicating the descriptor of FILE_TABLES")?;
                HashMap::try_from(Map::HashMap(MapData::from_fd(fd)?))?
            }
            _ => bail!("FILE_TABLES is not a hash map"),
        };
        Ok(TableMaps { tables: outer_fd(&self.ebpf, "TABLES")?, file_tables, pool: None })
    }

    /// Maps installed ahead of need for the tables built from now on, and the thread that
    /// keeps them ready.
    fn pool(&self) -> Result<pool::TablePool> {
        let slot_maps = match self.ebpf.map("SLOT_MAPS").context("SLOT_MAPS map")? {
            Map::Array(data) => {
                let fd = data.fd().as_fd().try_clone_to_owned().context("duplicating the descriptor of SLOT_MAPS")?;
                Array::try_from(Map::Array(MapData::from_fd(fd)?))?
            }
            _ => bail!("SLOT_MAPS is not an array"),
        };
        pool::TablePool::start(outer_fd(&self.ebpf, "TABLES")?, slot_maps)
    }
}

/// Creates each table's map, fills it and installs it in the outer array `outer` at its
/// slot; one result per table, in order, with a descriptor of a big table's map
/// ([`read_back_fd`]).
fn install_tables(outer: BorrowedFd<'_>, tables: &[(u32, &Table)]) -> Vec<InstallResult> {
    let maps: Vec<Result<MapData>> = tables.iter().map(|(slot, table)| table_map(*slot, table)).collect();
    let entries: Vec<_> = tables
        .iter()
        .zip(&maps)
        .filter_map(|((slot, _), map)| map.as_ref().ok().map(|m| (*slot, m.fd().as_fd())))
        .collect();
    let mut installed = outer::set_all(outer, &entries).into_iter();
    // The tables' own descriptors close here: the outer array holds the maps (and the
    // store the descriptors `read_back_fd` duplicated).
    tables
        .iter()
        .zip(maps)
        .map(|((slot, table), map)| {
            let map = map?;
            installed
                .next()
                .unwrap_or_else(|| Err(std::io::Error::other("not installed")))
                .with_context(|| format!("installing the unwind table in slot {slot}"))?;
            Ok(read_back_fd(&map, table))
        })
        .collect()
}

/// A descriptor of a big table's map, for userspace to read the table from rather than
/// keep its own copy (None if it cannot be had: the copy is kept). Only tables of
/// [`READ_BACK_BYTES`] or more: the memory is in a few big tables, and each descriptor
/// stays open for the whole session (a program maps hundreds of small libraries).
fn read_back_fd(map: &MapData, table: &Table) -> Option<std::os::fd::OwnedFd> {
    if table.is_mapped() || table.byte_size() < READ_BACK_BYTES {
        return None; // read from its cache entry, or small
    }
    map.fd().as_fd().try_clone_to_owned().inspect_err(|e| log::debug!("duplicating an unwind table's map: {e}")).ok()
}

/// Writes a table's elements into an mmapable array map through a shared mapping, a
/// window at a time: the map's pages are in memtrace's resident set while mapped
/// (libtorch_cpu's table is 20 MB), and so are the pages of a table read from its cache
/// entry, handed back after each window.
fn write_mmapped(map: &MapData, table: &Table) -> Result<()> {
    write_mmapped_by(map, table, 2 << 20)
}

/// [`write_mmapped`] through windows of `window` bytes (a multiple of pages).
fn write_mmapped_by(map: &MapData, table: &Table, window: usize) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    let bytes = (table.element_count() * 8).div_ceil(4096) * 4096;
    let fd = map.fd().as_fd().as_raw_fd();
    let mut elements = table.element_iter();
    for at in (0..bytes).step_by(window) {
        let len = window.min(bytes - at);
        // SAFETY: maps `len` bytes at page-aligned offset `at` of the array's memory (the
        // kernel sized it to hold every element, rounded up to pages, and `at + len` does
        // not pass that); nothing else aliases the mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                at as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: the mapping is page aligned and `len` bytes long, so it holds len / 8
        // u64s; the slice is dropped before it is unmapped, right after.
        unsafe {
            let window = std::slice::from_raw_parts_mut(ptr.cast::<u64>(), len / 8);
            for (slot, value) in window.iter_mut().zip(&mut elements) {
                *slot = value;
            }
            libc::munmap(ptr, len);
        }
        table.drop_resident();
    }
    Ok(())
}

impl SpaceSink for Probes {
    fn set_asid(&mut self, pid: u32, asid: u32, only_if_absent: bool) -> Result<u32> {
        let mut map: HashMap<_, u32, u32> = HashMap::try_from(self.ebpf.map_mut("ASIDS").context("ASIDS map")?)?;
        match map.insert(pid, asid, if only_if_absent { NOEXIST } else { 0 }) {
            Ok(()) => {
                self.bump_generation("PROC_GEN")?;
                Ok(asid)
            }
            Err(e) if only_if_absent => {
                map.get(&pid, 0).map_err(|_| anyhow::anyhow!("setting the address space of {pid}: {e}"))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn insert_mapping(&mut self, key: MappingKey, prefix_bits: u32, value: MappingValue) -> Result<()> {
        let mut trie: LpmTrie<_, MappingKey, MappingValue> =
            LpmTrie::try_from(self.ebpf.map_mut("MAPPINGS").context("MAPPINGS map")?)?;
        trie.insert(&Key::new(prefix_bits, key), value, 0).context("adding an address-space mapping")?;
        Ok(())
    }

    fn lookup_mapping(&self, asid: u32, addr: u64) -> Option<MappingValue> {
        let trie: LpmTrie<_, MappingKey, MappingValue> = LpmTrie::try_from(self.ebpf.map("MAPPINGS")?).ok()?;
        trie.get(&Key::new(MappingKey::ASID_BITS + 64, MappingKey::new(asid, addr)), 0).ok()
    }

    fn remove_mapping(&mut self, key: MappingKey, prefix_bits: u32) -> Result<()> {
        let mut trie: LpmTrie<_, MappingKey, MappingValue> =
            LpmTrie::try_from(self.ebpf.map_mut("MAPPINGS").context("MAPPINGS map")?)?;
        trie.remove(&Key::new(prefix_bits, key)).context("removing an address-space mapping")?;
        Ok(())
    }

    fn ranges_replaced(&mut self) -> Result<()> {
        self.bump_generation("RANGES_GEN")
    }

    fn remove_asid(&mut self, pid: u32, asid: u32) -> Result<()> {
        let mut map: HashMap<_, u32, u32> = HashMap::try_from(self.ebpf.map_mut("ASIDS").context("ASIDS map")?)?;
        if map.get(&pid, 0).ok() == Some(asid) {
            map.remove(&pid).context("removing an address space")?;
            self.bump_generation("PROC_GEN")?;
        }
        Ok(())
    }
}

/// A duplicate of the descriptor of the array of maps `name`.
fn outer_fd(ebpf: &Ebpf, name: &str) -> Result<std::os::fd::OwnedFd> {
    match ebpf.map(name).with_context(|| format!("{name} map"))? {
        Map::ArrayOfMaps(data) => {
            data.fd().as_fd().try_clone_to_owned().with_context(|| format!("duplicating the descriptor of {name}"))
        }
        _ => bail!("{name} is not an array of maps"),
    }
}

/// Creates one ring per possible CPU and starts installing each in the outer array on a
/// background thread (each install waits for an RCU grace period: ~25 ms that overlap the
/// programs' verification); [`Probes::rings_installed`] joins it before anything attaches.
fn install_rings(ebpf: &mut Ebpf, ring_bytes: u32) -> Result<(Vec<Ring>, RingsInstalling)> {
    if !ring_bytes.is_power_of_two() || ring_bytes < 4096 {
        bail!("ring size must be a power of two of at least 4096 bytes, not {ring_bytes}");
    }
    let cpus = possible_cpus()?;
    let mut created = Vec::with_capacity(cpus as usize);
    for cpu in 0..cpus {
        let obj = aya_obj::Map::new_from_params(BPF_MAP_TYPE_RINGBUF as u32, 0, 0, ring_bytes, 0);
        let data = MapData::create(obj, &format!("memtrace_rb{cpu}"), None)
            .with_context(|| format!("creating the ring buffer of CPU {cpu}"))?;
        created.push(data);
    }
    let outer = outer_fd(ebpf, "RINGS")?;
    let inner = created
        .iter()
        .map(|data| data.fd().as_fd().try_clone_to_owned())
        .collect::<std::io::Result<Vec<_>>>()
        .context("duplicating the descriptors of the ring buffers")?;
    let installing = std::thread::spawn(move || -> Result<()> {
        let entries: Vec<_> = inner.iter().zip(0..).map(|(fd, cpu)| (cpu, fd.as_fd())).collect();
        for (result, cpu) in outer::set_all(outer.as_fd(), &entries).into_iter().zip(0..) {
            result.with_context(|| format!("installing the ring buffer of CPU {cpu}"))?;
        }
        Ok(())
    });
    let mut rings = Vec::with_capacity(cpus as usize);
    for (data, cpu) in created.into_iter().zip(0u16..) {
        rings.push(Ring { cpu, ring: ring::RingReader::new(data, ring_bytes)? });
    }
    Ok((rings, Some(installing)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields a file's path is walked up through are all found in this kernel's BTF
    /// (`struct mount`, around each `vfsmount`, is the kernel's private type), where the
    /// walk expects them: `struct path` is {mnt, dentry}, and a `vfsmount` sits inside its
    /// mount after the mount's parent and mount point.
    #[test]
    fn the_path_walk_finds_its_fields_in_the_kernels_btf() {
        let layout = kernel_layout(&Btf::vmlinux().unwrap()).unwrap();
        assert_ne!(layout.dentry_parent, 0, "{layout:?}");
        assert_ne!(layout.dentry_name, 0, "{layout:?}");
        assert_ne!(layout.dentry_hash_pprev, 0, "{layout:?}");
        assert_eq!(layout.file_path_dentry, layout.file_path_mnt + 8, "{layout:?}");
        assert!(layout.mount_mnt > layout.mount_parent && layout.mount_mnt > layout.mount_mountpoint, "{layout:?}");
    }

    /// An allocator one of whose links fails is not left half probed: the links made before
    /// the failure are closed and its `mmap`/`munmap` points can be probed again by the next
    /// attach. Needs root (loads the probes); probes only this test's process.
    #[test]
    fn an_allocator_whose_attach_fails_midway_leaves_no_link() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: loading the probes needs root");
            return;
        }
        let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
            .into_iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.exists())
            .expect("the C library");
        let libc = allocator::resolve(&[libc], "").unwrap();
        assert!(libc.points.iter().any(|p| p.kind == Kind::Mmap), "libc's mmap is among its points");
        let mut broken = libc.clone();
        let mut missing = libc.points.iter().find(|p| p.kind == Kind::Malloc).unwrap().clone();
        // After libc's path in every order the links are made in (by path, then by point).
        missing.path = "/zz-memtrace-missing/libc.so.6".into();
        broken.points.push(missing);
        let mut probes = Probes::load(&Settings {
            all_processes: false,
            user_stacks: false,
            kernel_stacks: false,
            ring_bytes: 4096,
            follow_children: false,
            sample_bytes: None,
            call_graph: CallGraph::Fp,
            track_mappings: false,
            layout_cache: false,
        })
        .unwrap();
        let me = Some(std::process::id());
        let err = probes.attach_allocator(&broken, me).unwrap_err();
        assert!(format!("{err:#}").contains("zz-memtrace-missing"), "{err:#}");
        assert_eq!(probes.attachments.len(), 0, "the links made before the failure are closed");
        assert!(probes.mapping_points.is_empty(), "mmap/munmap/mremap no longer marked probed");
        probes.attach_allocator(&libc, me).unwrap();
        assert!(!probes.attachments.is_empty());
        assert_eq!(probes.mapping_points.len(), 3, "mmap, munmap and mremap, probed by the second attach");
    }

    /// A table written into a map of its own, a window at a time, is read back from that
    /// map (mapped only while lookups use it) as the table built here: every element,
    /// every lookup at and around its rows. Needs root (creates a BPF map).
    #[test]
    fn a_table_is_read_back_from_its_map_as_built() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: creating BPF maps needs root");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let built = crate::unwind::cfi::Cfi::open(&exe).unwrap().table().unwrap();
        assert!(built.byte_size() > 4 * 65536, "{} bytes: several windows", built.byte_size());
        let n = u32::try_from(built.element_count()).unwrap();
        let obj = aya_obj::Map::new_from_params(BPF_MAP_TYPE_ARRAY as u32, 4, 8, n, TABLE_FLAGS);
        let map = MapData::create(obj, "memtrace_uwtest", None).unwrap();
        write_mmapped_by(&map, &built, 65536).unwrap();
        let fd = read_back_fd(&map, &built).expect("a descriptor of the map");
        drop(map);
        let view = built.in_probes_map(fd).expect("the map holds the table");
        assert!(view.in_probes() && !built.in_probes());
        assert_eq!(view.probes_view_mapped(), Some(false), "not mapped until a lookup");
        assert_eq!(view.elements(), built.elements());
        let rows = built.decoded_rows();
        for w in rows.windows(2).step_by(3) {
            for vaddr in [w[0].pc, w[1].pc - 1, w[0].pc.wrapping_sub(1)] {
                assert_eq!(view.rule_at(vaddr), built.rule_at(vaddr), "{vaddr:#x}");
            }
        }
        assert_eq!(view.probes_view_mapped(), Some(true));
        view.release_if_idle(std::time::Duration::from_secs(3600));
        assert_eq!(view.probes_view_mapped(), Some(true), "used just now");
        view.release_if_idle(std::time::Duration::ZERO);
        assert_eq!(view.probes_view_mapped(), Some(false));
        let last = rows.last().unwrap().pc;
        assert_eq!(view.rule_at(last - 1), built.rule_at(last - 1), "mapped again");
    }
}
