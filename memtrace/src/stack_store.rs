//! Where the stacks of a [`crate::stacks::StackTable`] are kept: every stack's frames as
//! one tree of shared nodes (a node is a frame and the node of the frame that called it),
//! each stack the innermost node of its kernel part and of its user part. The stacks of a
//! heavy program share most of their frames (a million distinct PyTorch stacks are a
//! hundred frames deep, and differ in their innermost few): held as vectors of frames they
//! took gigabytes in a report. Equal stacks end at equal nodes, so duplicates are found
//! without comparing frames. Removing stacks (the agent's eviction) leaves their nodes
//! until they outnumber the frames of the stacks kept; then the tree is rebuilt.
use std::collections::BTreeMap;

use hashbrown::HashTable;

use crate::{
    FastMap,
    recording::{FileFrame, FileStack},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Frame {
    Kernel(u64),
    User(FileFrame),
}

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The caller's node (0: none; node n is `nodes[n - 1]`).
    parent: u32,
    frame: Frame,
}

/// A stack: its process, whether its walk was cut, and the innermost node of each part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Entry {
    pid: u32,
    kernel: u32,
    user: u32,
    truncated: bool,
}

#[derive(Default)]
pub struct StackStore {
    nodes: Vec<Node>,
    /// The nodes by (parent, frame): node numbers only, compared with the nodes they name
    /// (a map keyed by (parent, frame) held 40 bytes a node, 330 MB for a million stacks);
    /// dropped once a recording is read ([`Self::settle`]) and rebuilt at the next insert.
    index: Option<HashTable<u32>>,
    stacks: BTreeMap<u32, Entry>,
    /// Frames of the stacks kept, counted as vectors would hold them.
    frames_kept: usize,
    /// The last chain added of each part (outermost first, with its nodes): a stack read
    /// after another shares most of its callers with it, found without the index.
    last: [Vec<(Frame, u32)>; 2],
}

/// One stack of a [`StackStore`].
#[derive(Clone, Copy)]
pub struct StackRef<'a> {
    store: &'a StackStore,
    pub id: u32,
    pub pid: u32,
    pub truncated: bool,
    kernel: u32,
    user: u32,
}

impl<'a> StackRef<'a> {
    /// Kernel addresses, innermost first.
    pub fn kernel(&self) -> impl Iterator<Item = u64> + 'a {
        self.store.chain(self.kernel).filter_map(|f| match f {
            Frame::Kernel(a) => Some(a),
            Frame::User(_) => None,
        })
    }

    /// User frames, innermost first.
    pub fn user(&self) -> impl Iterator<Item = FileFrame> + 'a {
        self.store.chain(self.user).filter_map(|f| match f {
            Frame::User(f) => Some(f),
            Frame::Kernel(_) => None,
        })
    }

    pub fn to_file_stack(&self) -> FileStack {
        FileStack {
            id: self.id,
            pid: self.pid,
            kernel: self.kernel().collect(),
            user: self.user().collect(),
            truncated: self.truncated,
        }
    }
}

impl StackStore {
    /// Adds (or replaces) stack `s.id`.
    pub fn insert(&mut self, s: &FileStack) {
        let kernel = self.chain_of(0, s.kernel.iter().rev().map(|&a| Frame::Kernel(a)));
        let user = self.chain_of(1, s.user.iter().rev().map(|&f| Frame::User(f)));
        let entry = Entry { pid: s.pid, kernel, user, truncated: s.truncated };
        if let Some(old) = self.stacks.insert(s.id, entry) {
            self.frames_kept -= self.depth(old.kernel) + self.depth(old.user);
        }
        self.frames_kept += s.kernel.len() + s.user.len();
    }

    pub fn remove(&mut self, id: u32) {
        let Some(old) = self.stacks.remove(&id) else { return };
        self.frames_kept -= self.depth(old.kernel) + self.depth(old.user);
        if self.nodes.len() > 2 * self.frames_kept + 4096 {
            self.rebuild();
        }
    }

    /// Done adding for now: the index that shares nodes between inserts is dropped.
    pub fn settle(&mut self) {
        self.index = None;
        self.nodes.shrink_to_fit();
    }

    pub fn get(&self, id: u32) -> Option<StackRef<'_>> {
        self.stacks.get(&id).map(|&e| self.stack_ref(id, e))
    }

    /// Every stack, by id.
    pub fn iter(&self) -> impl Iterator<Item = StackRef<'_>> {
        self.stacks.iter().map(|(&id, &e)| self.stack_ref(id, e))
    }

    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }

    /// Every distinct frame of the stacks (and of stacks removed since the last rebuild).
    pub fn distinct_frames(&self) -> impl Iterator<Item = Frame> + '_ {
        self.nodes.iter().map(|n| n.frame)
    }

    /// Stacks with the same process, frames and cut as an earlier one (a stack finished
    /// from a copy is defined under the event's own id) → that first id.
    pub fn duplicates(&self) -> Vec<(u32, u32)> {
        let mut first: FastMap<Entry, u32> = FastMap::default();
        let mut out = Vec::new();
        for (&id, e) in &self.stacks {
            let canonical = *first.entry(*e).or_insert(id);
            if canonical != id {
                out.push((id, canonical));
            }
        }
        out
    }

    fn stack_ref(&self, id: u32, e: Entry) -> StackRef<'_> {
        StackRef { store: self, id, pid: e.pid, truncated: e.truncated, kernel: e.kernel, user: e.user }
    }

    /// The frames from `node` to the outermost.
    fn chain(&self, mut node: u32) -> impl Iterator<Item = Frame> + '_ {
        std::iter::from_fn(move || {
            let n = self.nodes.get((node as usize).checked_sub(1)?)?;
            node = n.parent;
            Some(n.frame)
        })
    }

    fn depth(&self, node: u32) -> usize {
        self.chain(node).count()
    }

    /// The node of the innermost of `frames` (given outermost first), adding what is new;
    /// `part` says which of [`Self::last`] to start from.
    fn chain_of(&mut self, part: usize, frames: impl Iterator<Item = Frame>) -> u32 {
        let nodes = &mut self.nodes;
        let last = &mut self.last[part];
        let index = self.index.get_or_insert_with(|| {
            let mut index = HashTable::with_capacity(nodes.len());
            for (i, n) in nodes.iter().enumerate() {
                index.insert_unique(key_hash(n.parent, n.frame), i as u32 + 1, |&id| node_hash(nodes, id));
            }
            index
        });
        let mut node = 0;
        let mut shared = 0;
        for frame in frames {
            if shared < last.len() && last[shared].0 == frame {
                node = last[shared].1;
                shared += 1;
                continue;
            }
            last.truncate(shared);
            shared = usize::MAX;
            let hash = key_hash(node, frame);
            let parent = node;
            node = match index
                .find(hash, |&id| nodes[id as usize - 1].parent == parent && nodes[id as usize - 1].frame == frame)
            {
                Some(&id) => id,
                None => {
                    nodes.push(Node { parent, frame });
                    let id = nodes.len() as u32;
                    index.insert_unique(hash, id, |&id| node_hash(nodes, id));
                    id
                }
            };
            last.push((frame, node));
        }
        if shared != usize::MAX {
            last.truncate(shared);
        }
        node
    }

    /// Keeps only the nodes of the stacks kept.
    fn rebuild(&mut self) {
        let stacks: Vec<FileStack> = self.iter().map(|s| s.to_file_stack()).collect();
        *self = Self::default();
        for s in &stacks {
            self.insert(s);
        }
    }
}

fn key_hash(parent: u32, frame: Frame) -> u64 {
    use std::hash::BuildHasher as _;
    foldhash::fast::FixedState::with_seed(0x7374_6163_6b73).hash_one((parent, frame))
}

fn node_hash(nodes: &[Node], id: u32) -> u64 {
    let n = nodes[id as usize - 1];
    key_hash(n.parent, n.frame)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn stack(id: u32, pid: u32, kernel: &[u64], user: &[u64], truncated: bool) -> FileStack {
        FileStack {
            id,
            pid,
            kernel: kernel.to_vec(),
            user: user.iter().map(|&o| FileFrame::Module { module: (o % 3) as u32, offset: o }).collect(),
            truncated,
        }
    }

    #[test]
    fn stacks_share_their_callers_frames() {
        let mut store = StackStore::default();
        store.insert(&stack(0, 1, &[], &[10, 20, 30, 40], false));
        store.insert(&stack(1, 1, &[], &[11, 20, 30, 40], false));
        store.insert(&stack(2, 1, &[7, 8], &[12, 30, 40], false));
        // 4 + 1 + 1 + the two kernel frames.
        assert_eq!(store.nodes.len(), 8);
        let s = store.get(1).unwrap();
        assert_eq!(s.user().map(|f| matches!(f, FileFrame::Module { offset, .. } if offset == 11)).next(), Some(true));
        assert_eq!(store.get(2).unwrap().kernel().collect::<Vec<_>>(), [7, 8]);
        assert!(store.get(3).is_none());
    }

    #[test]
    fn removed_stacks_leave_their_nodes_until_they_outnumber_the_kept() {
        let mut store = StackStore::default();
        let deep: Vec<u64> = (0..100).collect();
        for id in 0..100u32 {
            let mut user = deep.clone();
            user[0] = 1000 + u64::from(id);
            store.insert(&stack(id, 1, &[], &user, false));
        }
        assert_eq!(store.nodes.len(), 199);
        for id in 0..99u32 {
            store.remove(id);
        }
        assert_eq!(store.len(), 1);
        assert_eq!(store.frames_kept, 100);
        for id in 100..5000u32 {
            store.insert(&stack(id, 1, &[], &[id.into()], false));
            store.remove(id);
        }
        assert!(store.nodes.len() <= 2 * 100 + 4096, "{}", store.nodes.len());
        assert_eq!(store.get(99).unwrap().user().count(), 100);
    }

    proptest! {
        #[test]
        fn stacks_come_back_as_they_went_in(
            stacks in prop::collection::vec(
                (0u32..4, prop::collection::vec(0u64..6, 0..5), prop::collection::vec(0u64..6, 0..8), any::<bool>()),
                0..40,
            ),
            settle_at in 0usize..40,
        ) {
            let mut store = StackStore::default();
            let mut expected = BTreeMap::new();
            for (i, (pid, kernel, user, truncated)) in stacks.iter().enumerate() {
                if i == settle_at {
                    store.settle();
                }
                let s = stack(i as u32, *pid, kernel, user, *truncated);
                store.insert(&s);
                expected.insert(s.id, s);
            }
            prop_assert_eq!(store.len(), expected.len());
            for s in store.iter() {
                prop_assert_eq!(&s.to_file_stack(), &expected[&s.id]);
            }
            // Duplicates: exactly the stacks equal (but for their id) to an earlier one.
            let mut want = Vec::new();
            for (id, s) in &expected {
                let same = |o: &FileStack| o.pid == s.pid && o.kernel == s.kernel && o.user == s.user && o.truncated == s.truncated;
                if let Some(first) = expected.values().find(|o| same(o)) && first.id != *id {
                    want.push((*id, first.id));
                }
            }
            prop_assert_eq!(store.duplicates(), want);
        }
    }
}
