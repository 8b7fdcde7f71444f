//! Kernel allocations the views that count as they go (`top`, `serve`) set aside, told
//! apart as stacks arrive; `report` tells them apart from the recording's symbols by the
//! same rules ([`crate::stacks::StackTable::uprobe_stacks`], `slab_page_stacks`):
//! - the probes' own: a kernel stack through the uprobe machinery (breakpoint pages,
//!   return instances, the task storage of the BPF programs the probes run), or whose user
//!   code was the uprobes' own page (the return trampoline's first run in a process faults
//!   in its page tables). On a quiet service these were most of its kernel rows;
//! - slab pages: pages the slab allocators take (a new slab), whose objects count at their
//!   own kmalloc or kmem_cache_alloc.
//!
//! The kernel's functions are read once, from kallsyms (a `Send` table: `serve`'s model
//! moves between threads).
use crate::{
    event::{RawUserFrame, StackRecord},
    stacks::{is_slab_page_taker, is_uprobe_machinery},
};

/// Whether a user address is in the uprobes' own page (`[uprobes]`).
pub fn in_uprobes_page(addr: u64) -> bool {
    addr & !0xfff == memtrace_common::UPROBE_TRAMPOLINE_PAGE
}

/// What a kernel stack's allocations are, for the views that set some aside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SetAside {
    /// Made for the probes (counted apart, in no site).
    Probes,
    /// A slab's pages (counted apart where they are page allocations).
    SlabPages,
}

/// The kernel's functions as `/proc/kallsyms` lists them: where each starts, and which
/// set their allocations aside (2 MB for a kernel's ~150,000 functions, read once).
struct Functions {
    starts: Vec<u64>,
    classes: Vec<Option<SetAside>>,
}

impl Functions {
    fn read() -> Self {
        let all = crate::procfs::kernel_functions(|name| {
            if is_uprobe_machinery(name) {
                Some(SetAside::Probes)
            } else if is_slab_page_taker(name) {
                Some(SetAside::SlabPages)
            } else {
                None
            }
        });
        Self { starts: all.iter().map(|f| f.0).collect(), classes: all.iter().map(|f| f.1).collect() }
    }

    /// What the function holding `addr` sets aside, if anything.
    fn class(&self, addr: u64) -> Option<SetAside> {
        match self.starts.partition_point(|&s| s <= addr) {
            0 => None,
            i => self.classes[i - 1],
        }
    }
}

#[derive(Default)]
pub struct ProbeOverhead {
    /// Read at the first kernel stack.
    functions: Option<Functions>,
}

impl ProbeOverhead {
    /// What allocations with this stack are set aside as, if they are: the probes' own
    /// first (a slab page taken inside the uprobe machinery is the probes').
    pub fn classify(&mut self, s: &StackRecord) -> Option<SetAside> {
        if let Some(RawUserFrame::Ip(ip)) = s.user.first()
            && in_uprobes_page(*ip)
        {
            return Some(SetAside::Probes);
        }
        if s.kernel.is_empty() {
            return None;
        }
        let functions = self.functions.get_or_insert_with(Functions::read);
        // Innermost first: where the allocation was made, then return addresses, looked
        // up a byte before.
        let mut found = None;
        for class in s.kernel.iter().filter_map(|&a| functions.class(a.saturating_sub(1))) {
            if class == SetAside::Probes {
                return Some(class);
            }
            found = Some(class);
        }
        found
    }

    /// Whether allocations with this stack are the probes' own.
    pub fn is_probes(&mut self, s: &StackRecord) -> bool {
        self.classify(s) == Some(SetAside::Probes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real kernel's symbols (tests run as root, where kallsyms has addresses).
    fn kernel_function(name: &str) -> Option<u64> {
        crate::procfs::kernel_functions(|n| n == name).into_iter().find_map(|(a, hit)| hit.then_some(a))
    }

    #[test]
    fn the_uprobes_machinery_and_page_are_the_probes() {
        let record = |kernel: Vec<u64>, user: Vec<RawUserFrame>| StackRecord {
            hash: 1,
            pid: 1,
            kernel,
            user,
            walk: Default::default(),
            truncated: false,
            no_room: false,
            joined_kernel: true,
            miss: None,
            asid: 0,
            python_context: None,
            py_key: 0,
        };
        let mut o = ProbeOverhead::default();
        assert!(o.is_probes(&record(vec![], vec![RawUserFrame::Ip(memtrace_common::UPROBE_TRAMPOLINE_PAGE + 0x10)])));
        assert!(!o.is_probes(&record(vec![], vec![RawUserFrame::Ip(0x401000)])));
        let (Some(machinery), Some(other)) = (kernel_function("handle_swbp"), kernel_function("do_sys_openat2")) else {
            return; // no kernel addresses to read (not root)
        };
        // Return addresses point past the call: the function's own name at +1.
        assert!(o.is_probes(&record(vec![other + 1, machinery + 1], vec![RawUserFrame::Ip(0x401000)])));
        assert!(!o.is_probes(&record(vec![other + 1], vec![RawUserFrame::Ip(0x401000)])));
        assert_eq!(o.classify(&record(vec![other + 1], vec![RawUserFrame::Ip(0x401000)])), None);
        if let Some(slab) = kernel_function("allocate_slab") {
            let user = || vec![RawUserFrame::Ip(0x401000)];
            assert_eq!(o.classify(&record(vec![slab + 1, other + 1], user())), Some(SetAside::SlabPages));
            // A new slab inside the uprobe machinery is the probes'.
            assert_eq!(o.classify(&record(vec![slab + 1, machinery + 1], user())), Some(SetAside::Probes));
        }
    }
}
