//! Which address spaces a forked process's heap was copied from: its parent's, then the
//! parent's parent's while the parent had not exec'd, and so on. A free of a block
//! allocated there before the copy is the ancestor's block, not an unmatched free. Shared
//! by the [`super::Analyzer`] and [`super::unmatched::UnmatchedFrees`], which must count
//! alike.

/// Generations followed up: deeper fork chains without an exec are rare.
const GENERATIONS: usize = 8;

/// Forked processes, until they exec or exit.
#[derive(Debug, Default)]
pub(super) struct Forks {
    /// pid → the instances its heap was copied from, nearest first, each with the last
    /// time a block allocated there could have been copied down (the earliest fork on the
    /// way).
    chains: crate::FastMap<u32, Chain>,
    /// Live processes seen starting (forked or exec'd while traced); the others were
    /// running when tracing began.
    started: crate::FastSet<u32>,
    /// Children sharing their parent's memory (`vfork`, `posix_spawn`) until they exec
    /// or exit: their events are in their parent's address space.
    sharing: crate::FastSet<u32>,
}

#[derive(Debug, Default)]
struct Chain {
    spaces: Vec<(u32, u64)>,
    /// The first process of the chain was running before tracing began (`record -a`,
    /// `--pid`): its heap holds blocks allocated before, unseen, which its descendants
    /// copied too (a shell's subshell frees what the shell allocated).
    from_before_tracing: bool,
}

impl Forks {
    /// `child` was forked at `ts_ns` from `parent`, whose address space is `parent_space`
    /// (a parent that allocated nothing still has one to copy).
    pub fn forked(&mut self, child: u32, parent: u32, parent_space: u32, ts_ns: u64) {
        let mut spaces = vec![(parent_space, ts_ns)];
        let from_before_tracing = match self.chains.get(&parent) {
            Some(up) => {
                spaces.extend(up.spaces.iter().take(GENERATIONS - 1).map(|&(space, at)| (space, at.min(ts_ns))));
                up.from_before_tracing
            }
            None => !self.started.contains(&parent),
        };
        self.chains.insert(child, Chain { spaces, from_before_tracing });
        self.started.insert(child);
    }

    /// `child` was made sharing its parent's memory (`vfork`): its allocations and frees
    /// until it execs or exits are its parent's heap (a shell's child allocates there, and
    /// the shell frees those blocks once the child has exec'd).
    pub fn shared(&mut self, child: u32) {
        self.sharing.insert(child);
        self.started.insert(child);
    }

    /// `pid` exec'd or exited: whether it was sharing its parent's memory (which then
    /// lives on: only `pid`'s use of it ends).
    pub fn stops_sharing(&mut self, pid: u32) -> bool {
        self.sharing.remove(&pid)
    }

    /// `pid` exec'd (`exited`: false) or exited: its address space is its own from now on.
    pub fn ended(&mut self, pid: u32, exited: bool) {
        self.chains.remove(&pid);
        if exited {
            self.started.remove(&pid);
        } else {
            self.started.insert(pid);
        }
    }

    /// Whether `ptr`, freed by `pid` without an allocation of its own, is a block of a space
    /// its heap was copied from, allocated before the copy. `allocated(space, ptr)`: when
    /// the block live there was allocated; `freed(space, ptr)`: whether it was freed there
    /// lately (after the copy: the copy lives on). Any block not seen is, for a chain that
    /// starts in a process running before tracing began: one that process allocated before.
    pub fn inherited(
        &self,
        pid: u32,
        ptr: u64,
        allocated: impl Fn(u32, u64) -> Option<u64>,
        freed: impl Fn(u32, u64) -> bool,
    ) -> bool {
        let Some(chain) = self.chains.get(&pid) else { return false };
        chain.from_before_tracing
            || chain.spaces.iter().any(|&(space, copied_at)| match allocated(space, ptr) {
                Some(ts) => ts <= copied_at,
                None => freed(space, ptr),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_keeps_the_earliest_copy_time_and_stops_after_its_generations() {
        let mut f = Forks::default();
        f.ended(1, false); // exec'd while traced
        f.forked(2, 1, 10, 100);
        f.forked(3, 2, 20, 200);
        assert_eq!(f.chains[&3].spaces, [(20, 200), (10, 100)]);
        for pid in 4..20 {
            f.forked(pid, pid - 1, pid * 10, pid as u64 * 100);
        }
        assert_eq!(f.chains[&19].spaces.len(), GENERATIONS);
        let live = |space: u32, ptr: u64| (space == 10 && ptr == 0x1000).then_some(50);
        assert!(f.inherited(3, 0x1000, live, |_, _| false));
        assert!(!f.inherited(3, 0x2000, live, |_, _| false));
        assert!(f.inherited(3, 0x2000, live, |space, _| space == 20));
        f.ended(3, true);
        assert!(!f.inherited(3, 0x1000, live, |_, _| false));
    }

    #[test]
    fn a_chain_from_a_process_running_before_tracing_inherits_blocks_not_seen() {
        let mut f = Forks::default();
        let none = |_: u32, _: u64| None;
        // pid 1 was running when tracing began; 2 is its child, 3 its grandchild.
        f.forked(2, 1, 10, 100);
        f.forked(3, 2, 20, 200);
        assert!(f.inherited(2, 0x1000, none, |_, _| false));
        assert!(f.inherited(3, 0x1000, none, |_, _| false));
        // Once exec'd, its heap is its own, and so are its children's.
        f.ended(2, false);
        assert!(!f.inherited(2, 0x1000, none, |_, _| false));
        f.forked(4, 2, 30, 300);
        assert!(!f.inherited(4, 0x1000, none, |_, _| false));
        // A parent whose start was not seen (its pid's earlier process exited).
        f.ended(2, true);
        f.forked(5, 2, 40, 400);
        assert!(f.inherited(5, 0x1000, none, |_, _| false));
    }
}
