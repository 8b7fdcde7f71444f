//! The stage that gives user allocations their usable size (`bytes_alloc`) where the probes
//! did not read it: from the size classes of the family of the allocator that served the
//! call (the record's allocator index). Events must come in time order: a `realloc`'s
//! usable size may depend on the old block's (tcmalloc, mimalloc), which is remembered per
//! live block of those families.
use memtrace_common::{Kind, flags};

use super::{Family, jemalloc, mimalloc, tcmalloc};
use crate::{
    FastMap,
    event::{Alloc, Event, Free},
};

/// How one allocator's usable sizes are computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Model {
    /// The probes read it (glibc), or nobody knows (unknown families): left as it is.
    AsRecorded,
    Jemalloc(jemalloc::Config),
    /// tcmalloc's class table.
    Tcmalloc(Vec<u64>),
    Mimalloc,
    /// usable == requested.
    Requested,
}

impl Model {
    pub fn for_family(family: Family, tcmalloc_transfer_num_obj: Option<i64>) -> Self {
        match family {
            Family::Glibc | Family::Unknown => Self::AsRecorded,
            Family::Jemalloc => Self::Jemalloc(jemalloc::X86_64),
            Family::Tcmalloc => Self::Tcmalloc(tcmalloc::class_sizes(
                tcmalloc_transfer_num_obj.unwrap_or(tcmalloc::DEFAULT_TRANSFER_NUM_OBJ),
            )),
            Family::Mimalloc => Self::Mimalloc,
            Family::Musl => Self::Requested,
        }
    }

    fn tracks_live(&self) -> bool {
        matches!(self, Self::Tcmalloc(_) | Self::Mimalloc)
    }

    /// The usable size of a block of `kind` for `size` bytes aligned to `align` (0: none);
    /// `old`: for a realloc, the old block's usable size (`Some(None)`: it had one, not
    /// known). None: not known.
    pub fn usable(&self, kind: Kind, size: u64, align: u64, old: Option<Option<u64>>) -> Option<u64> {
        use Kind::*;
        match self {
            Self::AsRecorded => None,
            Self::Requested => Some(size),
            Self::Jemalloc(c) => match kind {
                Malloc | Calloc | Realloc | ReallocArray | New => c.s2u(size),
                PosixMemalign | AlignedAlloc | NewAligned => jemalloc::usable(*c, jemalloc::Api::Aligned, size, align),
                Memalign | Valloc | Mallocx | Rallocx => {
                    jemalloc::usable(*c, jemalloc::Api::AlignedNoBump, size, align)
                }
                _ => None,
            },
            Self::Tcmalloc(classes) => match kind {
                Malloc | Calloc | New => Some(tcmalloc::usable(classes, size, 0)),
                Realloc | ReallocArray => match old {
                    None => Some(tcmalloc::usable(classes, size, 0)),
                    Some(Some(old)) => Some(tcmalloc::realloc_usable(classes, old, size)),
                    Some(None) => None,
                },
                PosixMemalign | AlignedAlloc | Memalign | NewAligned | Valloc => {
                    Some(tcmalloc::usable(classes, size, align.max(1)))
                }
                Pvalloc => {
                    let size = if size == 0 { 4096 } else { size.div_ceil(4096) * 4096 };
                    Some(tcmalloc::usable(classes, size, 4096))
                }
                _ => None,
            },
            Self::Mimalloc => match kind {
                Malloc | Calloc | New => Some(mimalloc::usable(size)),
                Realloc | ReallocArray => match old {
                    None => Some(mimalloc::usable(size)),
                    Some(Some(old)) => Some(mimalloc::realloc_usable(old, size)),
                    Some(None) => None,
                },
                // Aligned blocks: a function of the request only in these cases (alloc-aligned.c).
                PosixMemalign | AlignedAlloc | Memalign | NewAligned | Valloc | Pvalloc => {
                    let size = if kind == Pvalloc { size.div_ceil(4096) * 4096 } else { size };
                    let align = align.max(1);
                    if size.is_power_of_two() && size <= 1024 && size >= align {
                        Some(size)
                    } else if align <= 64 << 10 && size + align - 1 > mimalloc::MEDIUM_OBJ_SIZE_MAX {
                        Some(mimalloc::usable(size + align - 1))
                    } else {
                        None
                    }
                }
                _ => None,
            },
        }
    }
}

/// Two reports of one free by nested probes come this close (a probe hit costs about a µs).
const NESTED_FREE_NS: u64 = 50_000;

/// Fills `bytes_alloc` of user allocations in a time-ordered stream of events, and drops
/// the second report of one free (a probed free function calling another: a shim's
/// `xyz_je_free` calling jemalloc's `dallocx`).
#[derive(Default)]
pub struct UsableSizes {
    /// Per thread: the (pid, block) it freed last, while no allocation returned that block,
    /// and when.
    last_free: FastMap<u32, ((u32, u64), u64)>,
    /// The reverse: which thread's last free a block is.
    freed_by: FastMap<(u32, u64), u32>,
    /// By allocator index minus one.
    models: Vec<Model>,
    /// Live blocks of tcmalloc and mimalloc, per process: their usable size.
    live: FastMap<u32, FastMap<u64, u64>>,
    /// A realloc's old block, by thread, between its free and its new block.
    realloc_old: FastMap<u32, Option<u64>>,
}

impl UsableSizes {
    /// Sets the model of allocator `index` (1-based, as the records carry it).
    pub fn set_model(&mut self, index: u8, model: Model) {
        let i = usize::from(index.max(1) - 1);
        if self.models.len() <= i {
            self.models.resize(i + 1, Model::AsRecorded);
        }
        self.models[i] = model;
    }

    fn model(&self, index: u8) -> Option<&Model> {
        self.models.get(usize::from(index.checked_sub(1)?))
    }

    /// Completes `event`; false when it only repeats a free already reported.
    pub fn apply(&mut self, event: &mut Event) -> bool {
        match event {
            Event::Alloc(a)
                if !a.kind.is_kernel() && !a.kind.is_gpu() && a.kind.space() != memtrace_common::Space::Mmap =>
            {
                if let Some(tid) = self.freed_by.remove(&(a.pid, a.ptr)) {
                    self.last_free.remove(&tid);
                }
                self.alloc(a);
            }
            Event::Free(f) if f.kind == Kind::Free => {
                // The same thread freeing the same block again at once with no allocation
                // of it in between: the same call seen by two probes (it could pair with
                // nothing). Further apart, it is the program's double free: kept.
                if let Some(&(block, at)) = self.last_free.get(&f.tid)
                    && block == (f.pid, f.ptr)
                    && f.ts_ns.saturating_sub(at) < NESTED_FREE_NS
                {
                    return false;
                }
                if let Some((previous, _)) = self.last_free.insert(f.tid, ((f.pid, f.ptr), f.ts_ns)) {
                    self.freed_by.remove(&previous);
                }
                self.freed_by.insert((f.pid, f.ptr), f.tid);
                self.free(f);
            }
            Event::Task(t)
                if matches!(t.event, memtrace_common::TaskEvent::Exec | memtrace_common::TaskEvent::Exit) =>
            {
                if t.pid == t.tid || t.event == memtrace_common::TaskEvent::Exec {
                    self.live.remove(&t.pid);
                }
                self.realloc_old.remove(&t.tid);
                if let Some((previous, _)) = self.last_free.remove(&t.tid) {
                    self.freed_by.remove(&previous);
                }
            }
            _ => {}
        }
        true
    }

    fn free(&mut self, f: &Free) {
        let old = self.live.get_mut(&f.pid).and_then(|m| m.remove(&f.ptr));
        // (An mremap's old mapping is not a heap block: no realloc takes it.)
        if f.flags & flags::BY_REALLOC != 0 && f.kind == Kind::Free {
            self.realloc_old.insert(f.tid, old);
        }
    }

    fn alloc(&mut self, a: &mut Alloc) {
        let realloc = matches!(a.kind, Kind::Realloc | Kind::ReallocArray | Kind::Rallocx);
        let old = if realloc { self.realloc_old.remove(&a.tid) } else { None };
        let Some(model) = self.model(a.allocator) else { return };
        if matches!(model, Model::AsRecorded) {
            return;
        }
        let align = if a.order > 0 { 1u64 << a.order.min(63) } else { 0 };
        let usable = if a.flags & flags::USABLE_EXACT != 0 {
            Some(a.bytes_alloc)
        } else {
            model.usable(a.kind, a.bytes_req, align, old).filter(|&u| u >= a.bytes_req)
        };
        a.order = 0;
        if let Some(u) = usable {
            a.bytes_alloc = u;
            a.flags |= flags::USABLE_EXACT;
        }
        if model.tracks_live() {
            let blocks = self.live.entry(a.pid).or_default();
            match usable {
                Some(u) => blocks.insert(a.ptr, u),
                None => blocks.remove(&a.ptr),
            };
        }
    }
}
