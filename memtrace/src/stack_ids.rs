//! Probe stack hash → recording stack id, ids given in order from 0.
//!
//! The recorder's one map that grows with every distinct stack (1.25 M on a PyTorch
//! script). A hash map of `(u64, u32)` pairs takes 17 bytes a bucket, and while it doubles
//! both tables are alive: 36 MB at 1.25 M stacks, 53 MB during the move. Here a bucket
//! holds the id alone (4 bytes and the table's control byte); the hashes are kept once, in
//! id order, in chunks of fixed size that never move: 21 MB at 1.25 M, 26 MB during a
//! move.

use hashbrown::HashTable;

/// Hashes per chunk (512 KiB).
const CHUNK: usize = 1 << 16;

#[derive(Default)]
pub struct StackIds {
    /// Ids, found by their hash.
    table: HashTable<u32>,
    /// The hash of each id: id `i` is `hashes[i / CHUNK][i % CHUNK]`.
    hashes: Vec<Vec<u64>>,
    len: u32,
}

/// Probe hashes are spread already; the multiply spreads the bits the table looks at
/// (its low bits and top seven) over all of them.
fn spread(hash: u64) -> u64 {
    hash.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(32)
}

impl StackIds {
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn hash_of(hashes: &[Vec<u64>], id: u32) -> u64 {
        let id = id as usize;
        hashes[id / CHUNK][id % CHUNK]
    }

    /// The id of `hash`, given now (the next in order) if it had none.
    pub fn id(&mut self, hash: u64) -> u32 {
        let Self { table, hashes, len } = self;
        let entry =
            table.entry(spread(hash), |&id| Self::hash_of(hashes, id) == hash, |&id| spread(Self::hash_of(hashes, id)));
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => *e.get(),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let id = *len;
                e.insert(id);
                if hashes.last().is_none_or(|c| c.len() == CHUNK) {
                    hashes.push(Vec::with_capacity(CHUNK));
                }
                hashes.last_mut().expect("pushed above").push(hash);
                *len += 1;
                id
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_come_in_order_and_last() {
        let mut ids = StackIds::default();
        assert!(ids.is_empty());
        assert_eq!(ids.id(42), 0);
        assert_eq!(ids.id(7), 1);
        assert_eq!(ids.id(42), 0);
        assert_eq!(ids.id(0), 2);
        assert_eq!(ids.id(u64::MAX), 3);
        assert_eq!(ids.id(7), 1);
        assert_eq!(ids.len(), 4);
    }

    #[test]
    fn ids_past_a_chunk_find_their_hashes() {
        let mut ids = StackIds::default();
        let n = CHUNK as u64 * 2 + 5;
        // Hashes that differ only in their high bits too.
        let hash = |i: u64| (i << 40) ^ i;
        for i in 0..n {
            assert_eq!(ids.id(hash(i)), i as u32);
        }
        for i in (0..n).rev() {
            assert_eq!(ids.id(hash(i)), i as u32);
        }
        assert_eq!(ids.len(), n as usize);
        assert_eq!(ids.hashes.len(), 3);
    }

    proptest! {
        /// The same ids as a plain map giving ids in order of first sight.
        #[test]
        fn same_ids_as_a_map(hashes in proptest::collection::vec(prop_oneof![0u64..64, any::<u64>()], 0..400)) {
            let mut ids = StackIds::default();
            let mut model = std::collections::HashMap::new();
            for h in hashes {
                let next = model.len() as u32;
                let want = *model.entry(h).or_insert(next);
                prop_assert_eq!(ids.id(h), want);
            }
            prop_assert_eq!(ids.len(), model.len());
        }
    }
}
