//! The probes' own kernel allocations, told apart as stacks arrive, for the views that
//! count as they go (`top`, `serve`); `report` tells them apart from the recording's
//! symbols ([`crate::stacks::StackTable::uprobe_stacks`]) by the same rule: a kernel stack
//! through the uprobe machinery (breakpoint pages, return instances, the task storage of
//! the BPF programs the probes run), or whose user code was the uprobes' own page (the
//! return trampoline's first run in a process faults in its page tables). On a quiet
//! service these were most of its kernel rows. The kernel's functions are read once, from
//! kallsyms (a `Send` table: `serve`'s model moves between threads).
use crate::{
    event::{RawUserFrame, StackRecord},
    stacks::is_uprobe_machinery,
};

/// Whether a user address is in the uprobes' own page (`[uprobes]`).
pub fn in_uprobes_page(addr: u64) -> bool {
    addr & !0xfff == memtrace_common::UPROBE_TRAMPOLINE_PAGE
}

/// The kernel's functions as `/proc/kallsyms` lists them: where each starts, and which
/// are the uprobe machinery's (2 MB for a kernel's ~150,000 functions, read once).
struct Functions {
    starts: Vec<u64>,
    machinery: Vec<bool>,
}

impl Functions {
    fn read() -> Self {
        let all = crate::procfs::kernel_functions(is_uprobe_machinery);
        Self { starts: all.iter().map(|f| f.0).collect(), machinery: all.iter().map(|f| f.1).collect() }
    }

    /// Whether the function holding `addr` is the uprobe machinery's.
    fn in_machinery(&self, addr: u64) -> bool {
        match self.starts.partition_point(|&s| s <= addr) {
            0 => false,
            i => self.machinery[i - 1],
        }
    }
}

#[derive(Default)]
pub struct ProbeOverhead {
    /// Read at the first kernel stack.
    functions: Option<Functions>,
}

impl ProbeOverhead {
    /// Whether allocations with this stack are the probes' own.
    pub fn is_probes(&mut self, s: &StackRecord) -> bool {
        if let Some(RawUserFrame::Ip(ip)) = s.user.first()
            && in_uprobes_page(*ip)
        {
            return true;
        }
        self.through_machinery(&s.kernel)
    }

    /// Whether one of these kernel addresses (innermost first: where the allocation was
    /// made, then return addresses, looked up a byte before) is in the uprobe machinery.
    pub fn through_machinery(&mut self, kernel: &[u64]) -> bool {
        if kernel.is_empty() {
            return false;
        }
        let functions = self.functions.get_or_insert_with(Functions::read);
        kernel.iter().any(|&a| functions.in_machinery(a.saturating_sub(1)))
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
    }
}
