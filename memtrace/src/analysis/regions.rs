//! Mappings freed by address range (mmap/munmap, cuMemMap/cuMemUnmap): which pieces of
//! each live mapping are still mapped. An unmap may take a whole mapping, its head, its
//! tail or a hole in it (glibc trims each new arena so: it maps 128 MiB and keeps an
//! aligned 64 MiB); what is left stays live with its bytes, and the mapping counts as freed
//! once, when its last piece goes. Pure bookkeeping: the analyzer counts what it returns.
use std::collections::BTreeMap;

use super::LiveBlock;

/// One mapped piece of a mapping: `[start, end)`, of which the first `req` bytes were asked
/// for (a mapping's requested bytes are a prefix of it, and so of each piece).
#[derive(Debug, Clone, Copy)]
struct Piece {
    end: u64,
    req: u64,
    id: u64,
}

/// A live mapping: its block, with the bytes of the pieces still mapped, and how many
/// pieces are left.
#[derive(Debug)]
struct Mapping {
    block: LiveBlock,
    pieces: u32,
}

/// What an unmap took from one mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cut {
    /// The mapping's block: with the bytes it had before this unmap when `gone`, else with
    /// the bytes this unmap took.
    pub block: LiveBlock,
    /// The mapping's last piece went: it is freed.
    pub gone: bool,
}

impl Cut {
    /// A block freed whole.
    pub fn whole(block: LiveBlock) -> Self {
        Self { block, gone: true }
    }
}

/// Live mappings of every process instance.
#[derive(Debug, Default)]
pub(super) struct Regions {
    /// (process instance, start) → piece.
    pieces: BTreeMap<(u32, u64), Piece>,
    mappings: crate::FastMap<u64, Mapping>,
    next_id: u64,
}

impl Regions {
    /// A mapping of `len` bytes at `start`. Whatever was mapped there before was unmapped
    /// first (by `MAP_FIXED`, or by an unmap not seen): returned as cuts.
    pub fn insert(&mut self, instance: u32, start: u64, len: u64, block: LiveBlock) -> Vec<Cut> {
        let end = start.saturating_add(len.max(1));
        let cuts = self.unmap(instance, start, end);
        let id = self.next_id;
        self.next_id += 1;
        self.pieces.insert((instance, start), Piece { end, req: block.bytes_req.min(end - start), id });
        self.mappings.insert(id, Mapping { block, pieces: 1 });
        cuts
    }

    /// Unmaps `[start, end)`: one cut per mapping it touched.
    pub fn unmap(&mut self, instance: u32, start: u64, end: u64) -> Vec<Cut> {
        let mut keys: Vec<(u32, u64)> = Vec::new();
        if let Some((&k, p)) = self.pieces.range((instance, 0)..(instance, start)).next_back()
            && p.end > start
        {
            keys.push(k);
        }
        keys.extend(self.pieces.range((instance, start)..(instance, end)).map(|(k, _)| *k));
        // (mapping id, its block before this unmap, bytes requested and mapped taken).
        let mut touched: Vec<(u64, LiveBlock, u64, u64)> = Vec::new();
        for key in keys {
            let Some(p) = self.pieces.remove(&key) else { continue };
            let s = key.1;
            let requested_in = |a: u64, b: u64| (s + p.req).min(b).saturating_sub(a);
            let (lo, hi) = (s.max(start), p.end.min(end));
            let mut left = 0;
            if s < lo {
                self.pieces.insert(key, Piece { end: lo, req: requested_in(s, lo), id: p.id });
                left += 1;
            }
            if hi < p.end {
                self.pieces.insert((instance, hi), Piece { end: p.end, req: requested_in(hi, p.end), id: p.id });
                left += 1;
            }
            let Some(m) = self.mappings.get_mut(&p.id) else { continue };
            let at = match touched.iter().position(|t| t.0 == p.id) {
                Some(i) => i,
                None => {
                    touched.push((p.id, m.block, 0, 0));
                    touched.len() - 1
                }
            };
            let (req, mapped) = (requested_in(lo, hi), hi - lo);
            touched[at].2 += req;
            touched[at].3 += mapped;
            m.block.bytes_req = m.block.bytes_req.saturating_sub(req);
            m.block.bytes_alloc = m.block.bytes_alloc.saturating_sub(mapped);
            m.pieces = m.pieces + left - 1;
        }
        touched
            .into_iter()
            .map(|(id, before, req, mapped)| {
                if self.mappings.get(&id).is_some_and(|m| m.pieces == 0) {
                    self.mappings.remove(&id);
                    Cut { block: before, gone: true }
                } else {
                    Cut { block: LiveBlock { bytes_req: req, bytes_alloc: mapped, ..before }, gone: false }
                }
            })
            .collect()
    }

    /// Takes every mapping of a process instance (its address space is gone), with the
    /// bytes still mapped.
    pub fn take_instance(&mut self, instance: u32) -> Vec<LiveBlock> {
        let keys: Vec<(u32, u64)> = self.pieces.range((instance, 0)..=(instance, u64::MAX)).map(|(k, _)| *k).collect();
        let mut blocks = Vec::new();
        for key in keys {
            if let Some(p) = self.pieces.remove(&key)
                && let Some(m) = self.mappings.remove(&p.id)
            {
                blocks.push(m.block);
            }
        }
        blocks
    }

    /// Every live mapping's block, once each.
    pub fn blocks(&self) -> impl Iterator<Item = &LiveBlock> {
        self.mappings.values().map(|m| &m.block)
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::Kind;

    use super::*;

    const MIB: u64 = 1 << 20;

    fn block(req: u64, alloc: u64) -> LiveBlock {
        LiveBlock {
            group: 1,
            ts_ns: 1,
            bytes_req: req,
            bytes_alloc: alloc,
            cpu: 0,
            pid: 1,
            tid: 1,
            stack: 1,
            kind: Kind::Mmap,
            orphaned: false,
            count: 1,
        }
    }

    fn sizes(cuts: &[Cut]) -> Vec<(u64, u64, bool)> {
        cuts.iter().map(|c| (c.block.bytes_req, c.block.bytes_alloc, c.gone)).collect()
    }

    fn live(r: &Regions) -> u64 {
        r.blocks().map(|b| b.bytes_alloc).sum()
    }

    #[test]
    fn a_head_a_tail_and_a_hole_free_their_bytes_and_keep_the_rest() {
        let mut r = Regions::default();
        let (a, b, c) = (0x1000_0000, 0x2000_0000, 0x3000_0000);
        for start in [a, b, c] {
            assert!(r.insert(1, start, 8 * MIB, block(8 * MIB, 8 * MIB)).is_empty());
        }
        assert_eq!(sizes(&r.unmap(1, a, a + 2 * MIB)), [(2 * MIB, 2 * MIB, false)]);
        assert_eq!(sizes(&r.unmap(1, b + 6 * MIB, b + 8 * MIB)), [(2 * MIB, 2 * MIB, false)]);
        assert_eq!(sizes(&r.unmap(1, c + 3 * MIB, c + 5 * MIB)), [(2 * MIB, 2 * MIB, false)]);
        assert_eq!((r.blocks().count(), live(&r)), (3, 18 * MIB));
        // The hole's two sides go in one unmap: freed once, with the 6 MiB left.
        assert_eq!(sizes(&r.unmap(1, c, c + 8 * MIB)), [(6 * MIB, 6 * MIB, true)]);
        // An unmap over the head's gap and the rest of a, and into nothing.
        assert_eq!(sizes(&r.unmap(1, a, a + 16 * MIB)), [(6 * MIB, 6 * MIB, true)]);
        assert_eq!((r.blocks().count(), live(&r)), (1, 6 * MIB));
        assert!(r.unmap(1, a, a + 8 * MIB).is_empty());
        assert!(r.unmap(2, b, b + 8 * MIB).is_empty(), "another process's addresses");
    }

    #[test]
    fn requested_bytes_are_a_prefix_of_the_mapping() {
        let mut r = Regions::default();
        r.insert(1, 0, 4 * 4096, block(2 * 4096 + 100, 4 * 4096));
        // The tail held no requested bytes but a page's worth past the request.
        assert_eq!(sizes(&r.unmap(1, 2 * 4096, 4 * 4096)), [(100, 2 * 4096, false)]);
        assert_eq!(sizes(&r.unmap(1, 0, 4096)), [(4096, 4096, false)]);
        assert_eq!(sizes(&r.unmap(1, 4096, 2 * 4096)), [(4096, 4096, true)]);
    }

    #[test]
    fn a_mapping_over_live_pieces_cuts_them_first() {
        let mut r = Regions::default();
        r.insert(1, 0x10000, 0x4000, block(0x4000, 0x4000));
        r.insert(1, 0x20000, 0x1000, block(0x1000, 0x1000));
        // MAP_FIXED over the second half of the first and the whole second.
        let cuts = r.insert(1, 0x12000, 0x10000, block(0x10000, 0x10000));
        assert_eq!(sizes(&cuts), [(0x2000, 0x2000, false), (0x1000, 0x1000, true)]);
        assert_eq!(live(&r), 0x2000 + 0x10000);
        let taken = r.take_instance(1);
        assert_eq!(taken.len(), 2);
        assert_eq!((r.blocks().count(), r.pieces.len()), (0, 0));
    }
}
