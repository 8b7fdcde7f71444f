//! Addresses each process freed lately (bounded), so that the allocator freeing the blocks
//! it cached for reuse (glibc's per-thread cache at thread exit) is told from the program
//! freeing blocks allocated before tracing began.
use std::collections::VecDeque;

/// Addresses a process freed recently (bounded), to recognise the allocator freeing the
/// blocks it cached for reuse.
#[derive(Default)]
pub(super) struct RecentFrees {
    /// Address → sequence number of its latest insertion.
    set: crate::FastMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    seq: u64,
}

impl RecentFrees {
    const CAPACITY: usize = 4096;

    pub(super) fn insert(&mut self, addr: u64) {
        self.seq += 1;
        self.set.insert(addr, self.seq);
        self.order.push_back((addr, self.seq));
        while self.order.len() > Self::CAPACITY {
            let Some((old, seq)) = self.order.pop_front() else {
                break;
            };
            // Only the latest insertion of an address evicts it.
            if self.set.get(&old) == Some(&seq) {
                self.set.remove(&old);
            }
        }
    }

    pub(super) fn remove(&mut self, addr: u64) {
        self.set.remove(&addr);
    }

    pub(super) fn contains(&self, addr: u64) -> bool {
        self.set.contains_key(&addr)
    }
}
