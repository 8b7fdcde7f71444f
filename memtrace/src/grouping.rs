//! The grouping vocabulary shared by `report`, `top` and `export`: what a row stands for
//! ([`GroupBy`], [`GroupKey`]), which allocations count ([`DomainFilter`], [`KindFilter`],
//! [`Filters`]), and how a row is named on one line ([`label`], [`shared_label`]).
use std::{collections::HashMap, sync::Arc};

use clap::ValueEnum;
use memtrace_common::{Kind, Space};
use serde::Serialize;

use crate::{
    analysis::{Domain, Origin},
    stacks::{Frame, StackTable},
};

/// How the name of the row of allocations without a stack begins.
const NO_STACK: &str = "[no stack: ";

/// What a row stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupBy {
    /// The code that called the allocator (first user frame; kernel: the call site).
    #[default]
    Site,
    /// The whole stack.
    Stack,
    /// The function containing the call site; in a Python process, the innermost Python
    /// function (the code the program's author wrote, as memray groups).
    Function,
    /// The process (command name and pid).
    Process,
}

impl GroupBy {
    /// What the rows are, in the plural ("call sites").
    pub fn plural(self) -> &'static str {
        match self {
            Self::Site => "call sites",
            Self::Stack => "stacks",
            Self::Function => "functions",
            Self::Process => "processes",
        }
    }

    /// `n` rows: "1 call site", "3 processes".
    pub fn count(self, n: usize) -> String {
        let one = match self {
            Self::Site => "call site",
            Self::Stack => "stack",
            Self::Function => "function",
            Self::Process => "process",
        };
        crate::units::counted(n as u64, one, self.plural())
    }

    /// The header of the column that names the rows.
    pub fn header(self) -> &'static str {
        match self {
            Self::Site => "SITE",
            Self::Stack => "STACK",
            Self::Function => "FUNCTION",
            Self::Process => "PROCESS",
        }
    }
}

/// A domain as reports and exports name it: `user` or `kernel`.
pub fn domain_name(d: Domain) -> &'static str {
    match d {
        Domain::User => "user",
        Domain::Reserved => "reserved",
        Domain::Kernel => "kernel",
        Domain::Gpu => "gpu",
        Domain::GpuAddress => "gpu_va",
    }
}

/// A domain in one letter, as table rows mark it: `U`, `R`, `K`.
pub fn domain_letter(d: Domain) -> &'static str {
    match d {
        Domain::User => "U",
        Domain::Reserved => "R",
        Domain::Kernel => "K",
        Domain::Gpu => "G",
        Domain::GpuAddress => "V",
    }
}

/// The domain of an allocation from `origin`: its kind's, except an mmap the allocator
/// made for itself ([`StackTable::is_reserved_mmap`]), which is reserved memory.
pub fn domain_of(origin: &Origin, stacks: &mut StackTable) -> Domain {
    if origin.kind == Kind::Mmap && stacks.is_reserved_mmap(origin.stack) {
        Domain::Reserved
    } else {
        Domain::of(origin.kind)
    }
}

/// User space, kernel, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum DomainFilter {
    /// User space: the program's allocations and the memory its allocator reserved.
    User,
    Kernel,
    /// GPU memory from the CUDA driver API, and GPU address ranges (`gpu_va`).
    Gpu,
    /// Every domain.
    #[default]
    Both,
}

impl DomainFilter {
    pub fn admits(self, d: Domain) -> bool {
        matches!(
            (self, d),
            (Self::Both, _)
                | (Self::User, Domain::User | Domain::Reserved)
                | (Self::Kernel, Domain::Kernel)
                | (Self::Gpu, Domain::Gpu | Domain::GpuAddress)
        )
    }
}

/// Allocation kinds a report can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KindFilter {
    /// Every user heap allocation (malloc family).
    Malloc,
    Calloc,
    Realloc,
    Memalign,
    Mmap,
    Kmalloc,
    /// kmem_cache_alloc.
    Cache,
    Page,
    /// User allocations: heap blocks and the program's own mmaps.
    User,
    /// Memory the C library and its allocator reserved for themselves: thread stacks,
    /// malloc arenas (mmaps made from inside the allocator's code).
    Reserved,
    Kernel,
    /// GPU memory (every CUDA driver allocation but address ranges).
    Gpu,
    /// cuMemAlloc_v2.
    Device,
    /// cuMemAllocAsync.
    Async,
    /// cuMemAllocFromPoolAsync.
    Pool,
    /// cuMemAllocManaged.
    Managed,
    /// cuMemAllocPitch_v2.
    Pitched,
    /// cuMemCreate.
    Physical,
    /// cuMemAddressReserve.
    Reserve,
    /// cuMemAllocHost_v2, cuMemHostAlloc.
    HostPinned,
    /// cuMemMap.
    Map,
}

impl KindFilter {
    /// Whether allocations of kind `k`, in domain `d`, are of this kind.
    pub fn admits_in(self, k: Kind, d: Domain) -> bool {
        match self {
            Self::User => d == Domain::User,
            Self::Reserved => d == Domain::Reserved,
            _ => self.admits(k),
        }
    }

    pub fn admits(self, k: Kind) -> bool {
        match self {
            Self::Malloc => k.space() == Space::Heap,
            Self::Calloc => k == Kind::Calloc,
            Self::Realloc => matches!(k, Kind::Realloc | Kind::ReallocArray),
            Self::Memalign => {
                matches!(k, Kind::Memalign | Kind::AlignedAlloc | Kind::PosixMemalign | Kind::Valloc | Kind::Pvalloc)
            }
            Self::Mmap => matches!(k, Kind::Mmap | Kind::MmapReserved),
            Self::Kmalloc => k == Kind::Kmalloc,
            Self::Cache => k == Kind::KmemCacheAlloc,
            Self::Page => k == Kind::PageAlloc,
            Self::User => !k.is_kernel() && !k.is_gpu(),
            Self::Reserved => matches!(k, Kind::Mmap | Kind::MmapReserved),
            Self::Kernel => k.is_kernel(),
            Self::Gpu => k.is_gpu() && !k.is_gpu_address(),
            Self::Device => k == Kind::GpuDevice,
            Self::Async => k == Kind::GpuAsync,
            Self::Pool => k == Kind::GpuPool,
            Self::Managed => k == Kind::GpuManaged,
            Self::Pitched => k == Kind::GpuPitched,
            Self::Physical => k == Kind::GpuPhysical,
            Self::Reserve => k == Kind::GpuReserve,
            Self::HostPinned => k == Kind::GpuHostPinned,
            Self::Map => k == Kind::GpuMap,
        }
    }
}

/// Which allocations a report or an export counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters {
    pub domain: DomainFilter,
    /// Only this process.
    pub pid: Option<u32>,
    /// Only processes with this command name.
    pub comm: Option<String>,
    /// Only allocations of at least this many bytes requested.
    pub min_size: Option<u64>,
    /// Only these kinds (none: every kind).
    pub kinds: Vec<KindFilter>,
    /// Only user allocations served by this allocator: a family (jemalloc, ...), a prefix
    /// or part of the module's path.
    pub allocator: Option<String>,
}

impl Filters {
    /// Whether every allocation counts (no filter but the domain).
    pub fn is_empty(&self) -> bool {
        self.pid.is_none()
            && self.comm.is_none()
            && self.min_size.is_none()
            && self.kinds.is_empty()
            && self.allocator.is_none()
    }

    /// Whether allocations of this kind count (domain and kinds).
    pub fn admits_kind(&self, kind: Kind) -> bool {
        self.admits_in(kind, Domain::of(kind))
    }

    /// Whether allocations of this kind, in domain `domain`, count.
    pub fn admits_in(&self, kind: Kind, domain: Domain) -> bool {
        self.domain.admits(domain) && (self.kinds.is_empty() || self.kinds.iter().any(|k| k.admits_in(kind, domain)))
    }

    /// Whether the events of process `pid` count, its command name being in `comms`.
    pub fn admits_process(&self, pid: u32, comms: &HashMap<u32, String>) -> bool {
        self.pid.is_none_or(|p| p == pid) && self.comm.as_ref().is_none_or(|c| comms.get(&pid).is_some_and(|n| n == c))
    }

    /// Whether an allocation of `bytes_req` bytes is large enough to count.
    pub fn admits_size(&self, bytes_req: u64) -> bool {
        self.min_size.is_none_or(|m| bytes_req >= m)
    }
}

/// What a row is made of: allocations with the same key are one row.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKey {
    /// (module, address) of the first frame of the domain; for unknown stacks, the kind as
    /// `[no stack: kind]` and address 0.
    Site(Domain, Arc<str>, u64),
    /// The function of that frame.
    Function(Domain, Arc<str>),
    Process(Domain, u32),
    /// (stack, call site, pid): the pid is 0 unless each process's share is kept apart
    /// ([`GroupKey::per_process`]).
    Stack(Domain, u64, u64, u32),
}

impl GroupKey {
    /// The row of an allocation from `origin`, grouped `by`; `stacks` names its frames.
    pub fn of(origin: &Origin, by: GroupBy, stacks: &mut StackTable) -> Self {
        let domain = domain_of(origin, stacks);
        match by {
            GroupBy::Stack => Self::Stack(domain, origin.stack, origin.call_site, 0),
            GroupBy::Process => Self::Process(domain, origin.pid),
            GroupBy::Site | GroupBy::Function => {
                // Only the frame the row is named after: every distinct stack comes here.
                let python = by == GroupBy::Function && domain != Domain::Kernel;
                match (stacks.key_frame(origin.stack, origin.call_site, domain, python), by) {
                    (Some(f), GroupBy::Site) => Self::Site(domain, f.module, f.address),
                    (Some(f), _) => Self::Function(domain, f.function),
                    (None, _) => Self::Site(domain, format!("{NO_STACK}{}]", origin.kind.name()).into(), 0),
                }
            }
        }
    }

    /// The same stack, but only the allocations of process `pid` (exports put the process
    /// at the root of every stack). Other keys are unchanged.
    pub fn per_process(self, pid: u32) -> Self {
        match self {
            Self::Stack(domain, stack, call_site, _) => Self::Stack(domain, stack, call_site, pid),
            other => other,
        }
    }

    /// The row of allocations without a frame of their domain (`[no stack: malloc]`).
    pub fn is_stackless(&self) -> bool {
        matches!(self, Self::Site(_, module, 0) if module.starts_with(NO_STACK))
    }

    pub fn domain(&self) -> Domain {
        match self {
            Self::Site(d, ..) | Self::Function(d, _) | Self::Process(d, _) | Self::Stack(d, ..) => *d,
        }
    }
}

/// The frame a row is named after: the first user frame of user allocations that is not
/// an allocation wrapper's ([`crate::wrappers`]; the first user frame if all are), as a user
/// stack may start with the kernel frames of a system call and with `alloc::alloc::alloc`
/// or `xmalloc`; the first frame of kernel ones.
pub fn first_frame(domain: Domain, frames: &[Frame]) -> Option<&Frame> {
    frames.get(first_frame_index(domain, frames)?)
}

fn first_frame_index(domain: Domain, frames: &[Frame]) -> Option<usize> {
    match domain {
        Domain::User | Domain::Reserved | Domain::Gpu | Domain::GpuAddress => {
            let start = frames.iter().position(|f| !f.kernel)?;
            // Past the last wrapper frame of the leading run of wrappers' and unnamed
            // frames (a wrapper's static helper without a symbol sits under it).
            let mut last_wrapper = None;
            for (i, f) in frames.iter().enumerate().skip(start) {
                if f.wrapper {
                    last_wrapper = Some(i);
                } else if !f.unknown {
                    break;
                }
            }
            match last_wrapper {
                Some(w) if w + 1 < frames.len() => Some(w + 1),
                _ => Some(start),
            }
        }
        Domain::Kernel => (!frames.is_empty()).then_some(0),
    }
}

/// Where a row's stack starts when it is shown whole (`--by stack`): its first user frame
/// for user allocations, wrappers included (the whole stack follows its first frame).
pub fn stack_start(domain: Domain, frames: &[Frame]) -> usize {
    match domain {
        Domain::Kernel => 0,
        _ => frames.iter().position(|f| !f.kernel).unwrap_or(0),
    }
}

/// The frames from the one a row is named after (all of them if there is none).
pub fn site_frames(domain: Domain, frames: &[Frame]) -> &[Frame] {
    &frames[first_frame_index(domain, frames).unwrap_or(0)..]
}

/// Frames a one-line site label shows: the site and two callers.
pub const LABEL_FRAMES: usize = 3;

/// A row's name on one line: `comm [pid]` for a process, the function's name, the kind for
/// allocations without a stack, else the site and two callers (`f (a.c:1) ← g (a.c:9)`,
/// with ` ← …` when a user stack goes on).
pub fn label(key: &GroupKey, frames: &[Frame], comms: &HashMap<u32, String>) -> String {
    match key {
        GroupKey::Process(_, pid) => format!("{} [{pid}]", process_name(*pid, comms)),
        GroupKey::Function(_, name) => name.to_string(),
        GroupKey::Site(_, module, _) if frames.is_empty() || key.is_stackless() => module.to_string(),
        _ => {
            let domain = key.domain();
            let frames = site_frames(domain, frames);
            let mut s = frames.iter().take(LABEL_FRAMES).map(|f| f.to_string()).collect::<Vec<_>>().join(" ← ");
            if domain != Domain::Kernel && frames.len() > LABEL_FRAMES {
                s.push_str(" ← …");
            }
            s
        }
    }
}

/// A row's name on one line from the stacks of all its allocations (`stacks[0]` is the one
/// it shows). A call site reached from several places is not named after one of them: it
/// shows the frames all its stacks share from the site on, then where they part
/// `[N callers]`, N the distinct frames there (`xmalloc ← [37 callers]`, where one stack's
/// callers would have named a caller of a few of its allocations for all of them). A stack
/// that ends sooner (cut short) parts from none. Other rows, and sites whose stacks agree
/// on every frame a label shows, are named as [`label`] (by their longest stack).
pub fn shared_label(key: &GroupKey, stacks: &[Vec<Frame>], comms: &HashMap<u32, String>) -> String {
    let lead = stacks.first().map_or(&[][..], |s| &s[..]);
    // Not a site row, one stack, or the row of allocations without a user frame
    // (`[no stack: malloc]`): named as always.
    if !matches!(key, GroupKey::Site(..)) || key.is_stackless() || stacks.len() < 2 {
        return label(key, lead, comms);
    }
    let domain = key.domain();
    let shown: Vec<Vec<String>> = stacks
        .iter()
        .map(|s| site_frames(domain, s).iter().take(LABEL_FRAMES).map(|f| f.to_string()).collect())
        .collect();
    let mut shared: Vec<&String> = Vec::new();
    while shared.len() < LABEL_FRAMES {
        let at: std::collections::BTreeSet<&String> = shown.iter().filter_map(|s| s.get(shared.len())).collect();
        match at.len() {
            0 => break,
            1 => shared.extend(at),
            n if !shared.is_empty() => {
                let shared: Vec<&str> = shared.iter().map(|s| s.as_str()).collect();
                return format!("{} ← [{n} callers]", shared.join(" ← "));
            }
            _ => break,
        }
    }
    let longest = stacks.iter().max_by_key(|s| site_frames(domain, s).len()).map_or(lead, |s| &s[..]);
    label(key, longest, comms)
}

/// The name of a row that shows `frames` (of its first stack and call site, `first`) and
/// holds the stacks `held` too (`first` may be among them): [`shared_label`] of them all,
/// each of the others named as far as a label needs.
pub fn row_label(
    key: &GroupKey,
    frames: &[Frame],
    first: (u64, u64),
    held: &[(u64, u64)],
    stacks: &StackTable,
    comms: &HashMap<u32, String>,
) -> String {
    let mut named = vec![frames.to_vec()];
    named.extend(
        held.iter()
            .filter(|&&s| s != first)
            .map(|&(stack, call_site)| stacks.frames_prefix(stack, call_site, LABEL_FRAMES + 1)),
    );
    shared_label(key, &named, comms)
}

/// A process's name: its command name; the idle task's (`swapper`, whose context kernel
/// allocations in interrupts run in) for pid 0; else `pid N`.
pub fn process_name(pid: u32, comms: &HashMap<u32, String>) -> String {
    match comms.get(&pid) {
        Some(comm) => comm.clone(),
        None if pid == 0 => "swapper".into(),
        None => format!("pid {pid}"),
    }
}

/// Whether a row matches a case-insensitive text filter (`top`'s `/`): in its label or
/// the function of any of its frames. An empty filter matches every row.
pub fn matches_text(filter_lowercase: &str, label: &str, frames: &[Frame]) -> bool {
    filter_lowercase.is_empty()
        || label.to_lowercase().contains(filter_lowercase)
        || frames.iter().any(|f| f.function.to_lowercase().contains(filter_lowercase))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, kernel: bool) -> Frame {
        Frame {
            function: function.into(),
            file: (!kernel).then(|| "/src/app.c".into()),
            line: (!kernel).then_some(7),
            module: if kernel { "[kernel]".into() } else { "app".into() },
            address: 0x10,
            kernel,
            inlined: false,
            python: false,
            unknown: false,
            wrapper: false,
        }
    }

    #[test]
    fn labels_name_the_site_and_two_callers() {
        let comms = HashMap::from([(42, "prog".to_string())]);
        let frames: Vec<Frame> =
            vec![frame("sys_brk", true), frame("a", false), frame("b", false), frame("c", false), frame("main", false)];
        let key = GroupKey::Site(Domain::User, "app".into(), 0x10);
        assert_eq!(label(&key, &frames, &comms), "a (app.c:7) ← b (app.c:7) ← c (app.c:7) ← …");
        assert_eq!(label(&key, &frames[..3], &comms), "a (app.c:7) ← b (app.c:7)");
        let kernel = GroupKey::Stack(Domain::Kernel, 1, 0, 0);
        assert_eq!(label(&kernel, &frames, &comms), "sys_brk ← a (app.c:7) ← b (app.c:7)");
        assert_eq!(label(&GroupKey::Process(Domain::User, 42), &frames, &comms), "prog [42]");
        assert_eq!(label(&GroupKey::Process(Domain::User, 7), &frames, &comms), "pid 7 [7]");
        assert_eq!(label(&GroupKey::Process(Domain::Kernel, 0), &frames, &comms), "swapper [0]");
        assert_eq!(label(&GroupKey::Function(Domain::User, "a".into()), &frames, &comms), "a");
        let none = GroupKey::Site(Domain::User, "[no stack: malloc]".into(), 0);
        assert_eq!(label(&none, &[], &comms), "[no stack: malloc]");
    }

    #[test]
    fn a_site_reached_from_several_places_names_only_what_its_stacks_share() {
        let comms = HashMap::new();
        let key = GroupKey::Site(Domain::User, "app".into(), 0x10);
        let stack = |names: &[&str]| names.iter().map(|n| frame(n, false)).collect::<Vec<_>>();
        let (a, b, c) = (stack(&["xmalloc", "f", "main"]), stack(&["xmalloc", "g", "main"]), stack(&["xmalloc", "h"]));
        assert_eq!(shared_label(&key, &[a.clone(), b.clone(), c], &comms), "xmalloc (app.c:7) ← [3 callers]");
        // Shared callers are shown up to where the stacks part; a stack ending sooner (cut
        // short) parts from none.
        let (d, e) = (stack(&["xmalloc", "f", "g", "main"]), stack(&["xmalloc", "f", "h", "main"]));
        let short = stack(&["xmalloc", "f"]);
        assert_eq!(
            shared_label(&key, &[d.clone(), e, short.clone()], &comms),
            "xmalloc (app.c:7) ← f (app.c:7) ← [2 callers]"
        );
        assert_eq!(shared_label(&key, &[short, d.clone()], &comms), label(&key, &d, &comms), "named by the longest");
        // Stacks that agree on every frame a label shows, or one stack, are named as `label`.
        let f = stack(&["xmalloc", "f", "g", "other"]);
        assert_eq!(shared_label(&key, &[d.clone(), f], &comms), label(&key, &d, &comms));
        assert_eq!(shared_label(&key, &[a.clone(), a.clone()], &comms), label(&key, &a, &comms));
        assert_eq!(shared_label(&key, std::slice::from_ref(&b), &comms), label(&key, &b, &comms));
        // Kernel sites part the same way; other rows are named by their first stack.
        let k = |names: &[&str]| names.iter().map(|n| frame(n, true)).collect::<Vec<_>>();
        let ksite = GroupKey::Site(Domain::Kernel, "[kernel]".into(), 0x10);
        assert_eq!(
            shared_label(&ksite, &[k(&["kmalloc", "x"]), k(&["kmalloc", "y"])], &comms),
            "kmalloc ← [2 callers]"
        );
        let by_fn = GroupKey::Function(Domain::User, "xmalloc".into());
        assert_eq!(shared_label(&by_fn, &[a.clone(), b], &comms), "xmalloc");
        // Allocations without a user frame keep their row's name whatever else their
        // stacks hold (kernel frames of a system call).
        let none = GroupKey::Site(Domain::User, "[no stack: mmap]".into(), 0);
        let syscall = vec![frame("__x64_sys_mmap", true)];
        assert_eq!(shared_label(&none, &[vec![], syscall.clone(), a], &comms), "[no stack: mmap]");
        assert_eq!(shared_label(&none, &[syscall.clone(), syscall], &comms), "[no stack: mmap]");
    }

    #[test]
    fn filters_select_domains_kinds_processes_and_sizes() {
        let comms = HashMap::from([(1, "a".to_string()), (2, "b".to_string())]);
        let f = Filters {
            domain: DomainFilter::User,
            pid: None,
            comm: Some("b".into()),
            min_size: Some(64),
            kinds: vec![KindFilter::Calloc, KindFilter::Mmap],
            allocator: None,
        };
        assert!(f.admits_kind(Kind::Calloc) && f.admits_kind(Kind::Mmap));
        assert!(!f.admits_kind(Kind::Malloc) && !f.admits_kind(Kind::Kmalloc));
        assert!(f.admits_process(2, &comms) && !f.admits_process(1, &comms) && !f.admits_process(3, &comms));
        assert!(f.admits_size(64) && !f.admits_size(63));
        let all = Filters::default();
        assert!(all.admits_kind(Kind::PageAlloc) && all.admits_process(3, &comms) && all.admits_size(0));
        assert!(KindFilter::Malloc.admits(Kind::Calloc) && !KindFilter::Malloc.admits(Kind::Mmap));
    }

    #[test]
    fn text_filters_look_at_labels_and_frames() {
        let frames = vec![frame("parse_request", false), frame("serve", false)];
        assert!(matches_text("", "x", &frames));
        assert!(matches_text("serve", "parse_request (app.c:7)", &frames));
        assert!(matches_text("app.c", "parse_request (app.c:7)", &frames));
        assert!(!matches_text("main", "parse_request (app.c:7)", &frames));
    }
}
