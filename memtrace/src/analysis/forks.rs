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
    chains: crate::FastMap<u32, Vec<(u32, u64)>>,
}

impl Forks {
    /// `child` was forked at `ts_ns` from `parent`, whose address space is `parent_space`
    /// (a parent that allocated nothing still has one to copy).
    pub fn forked(&mut self, child: u32, parent: u32, parent_space: u32, ts_ns: u64) {
        let mut chain = vec![(parent_space, ts_ns)];
        if let Some(up) = self.chains.get(&parent) {
            chain.extend(up.iter().take(GENERATIONS - 1).map(|&(space, at)| (space, at.min(ts_ns))));
        }
        self.chains.insert(child, chain);
    }

    /// `pid`'s address space is its own from now on (exec, exit).
    pub fn ended(&mut self, pid: u32) {
        self.chains.remove(&pid);
    }

    /// Whether `ptr`, freed by `pid` without an allocation of its own, is a block of a space
    /// its heap was copied from, allocated before the copy. `allocated(space, ptr)`: when
    /// the block live there was allocated; `freed(space, ptr)`: whether it was freed there
    /// lately (after the copy: the copy lives on).
    pub fn inherited(
        &self,
        pid: u32,
        ptr: u64,
        allocated: impl Fn(u32, u64) -> Option<u64>,
        freed: impl Fn(u32, u64) -> bool,
    ) -> bool {
        let Some(chain) = self.chains.get(&pid) else { return false };
        chain.iter().any(|&(space, copied_at)| match allocated(space, ptr) {
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
        f.forked(2, 1, 10, 100);
        f.forked(3, 2, 20, 200);
        assert_eq!(f.chains[&3], [(20, 200), (10, 100)]);
        for pid in 4..20 {
            f.forked(pid, pid - 1, pid * 10, pid as u64 * 100);
        }
        assert_eq!(f.chains[&19].len(), GENERATIONS);
        let live = |space: u32, ptr: u64| (space == 10 && ptr == 0x1000).then_some(50);
        assert!(f.inherited(3, 0x1000, live, |_, _| false));
        assert!(!f.inherited(3, 0x2000, live, |_, _| false));
        assert!(f.inherited(3, 0x2000, live, |space, _| space == 20));
        f.ended(3);
        assert!(!f.inherited(3, 0x1000, live, |_, _| false));
    }
}
