//! One stack for many copies. The probes give every stack copy (a walk that met a frame
//! whose table was not ready) a hash of its own, used by the one allocation it came with;
//! once finished, most copies are the same stack as others (a library's first calls while
//! its table is built, a module's initialisation). This names each finished copy by its
//! content instead, so the sinks name, symbolize and store each distinct stack once, and
//! rewrites the hash of the allocation that used the copy to match.
//!
//! An allocation released to the sinks before its copy was finished (the copy waited longer
//! than the time-ordering window for a table) keeps the copy's own hash, and the copy is
//! then delivered under it, as without this.
use memtrace_common::stack_hash_step;

use crate::{
    FastMap, FastSet,
    event::{RawUserFrame, StackMiss, StackRecord},
};

/// Renames and delivered contents kept at most (a long `serve -a` meets copies all along).
const MAX_RENAMED: usize = 1 << 20;
const MAX_DELIVERED: usize = 1 << 18;

/// Seeds the content hash: never the seed of a stack the probes walked.
const CONTENT_SEED: u64 = 0x636f_7079_2d6f_6e65;

#[derive(Default)]
pub struct CopyNames {
    /// Copies waiting for a table (by the hash the probes gave them).
    waiting: FastSet<u64>,
    /// Copies waiting whose allocation went out with their own hash.
    released_early: FastSet<u64>,
    /// Finished copies whose allocation has not gone out yet: their content's hash.
    renamed: FastMap<u64, u64>,
    /// Content hashes delivered to the sinks.
    delivered: FastSet<u64>,
    /// Copies delivered under their content's hash where another had been already.
    pub merged: u64,
}

impl CopyNames {
    /// A copy is waiting for a table.
    pub fn waiting(&mut self, hash: u64) {
        self.waiting.insert(hash);
    }

    /// A copy is finished (`stack`, under the probes' hash): the stack to deliver, under its
    /// content's hash unless its allocation went out already; None when that content was
    /// delivered before.
    pub fn finished(&mut self, mut stack: StackRecord) -> Option<StackRecord> {
        let hash = stack.hash;
        self.waiting.remove(&hash);
        if self.released_early.remove(&hash) {
            return Some(stack);
        }
        let content = content_hash(&stack);
        if self.renamed.len() >= MAX_RENAMED {
            // Allocations lost in the rings leave their copy's rename behind: bounded.
            self.renamed.clear();
        }
        self.renamed.insert(hash, content);
        if self.delivered.len() >= MAX_DELIVERED {
            // A content delivered again is only delivered twice; memory stays bounded.
            self.delivered.clear();
        }
        if !self.delivered.insert(content) {
            self.merged += 1;
            return None;
        }
        stack.hash = content;
        Some(stack)
    }

    /// The stack hash an allocation with stack `hash` goes out with.
    pub fn released(&mut self, hash: u64) -> u64 {
        if self.renamed.is_empty() && self.waiting.is_empty() {
            return hash;
        }
        if let Some(content) = self.renamed.remove(&hash) {
            return content;
        }
        if self.waiting.contains(&hash) {
            self.released_early.insert(hash);
        }
        hash
    }

    /// Forgets what no allocation will ask for any more (at the end of a session).
    pub fn clear(&mut self) {
        self.waiting.clear();
        self.released_early.clear();
        self.renamed.clear();
    }
}

/// Copies each ring carried last, for the kernel allocations of one syscall that refer to
/// the copy an earlier one sent (`memtrace_common::stack_flags::COPY_REPEAT`): the probes
/// send the copy once, userspace finishes each allocation's stack with it.
#[derive(Default)]
pub struct RecentCopies {
    rings: Vec<std::collections::VecDeque<(u64, Box<StackMiss>)>>,
    /// References finished with their copy, and those whose copy was not found (cut short).
    pub matched: u64,
    pub unmatched: u64,
}

/// Copies kept per ring: a reference comes from the same syscall on the same CPU, after
/// its copy and before that CPU sends another (an interrupt's allocation may, in between:
/// the probes then walk again).
const RECENT_PER_RING: usize = 2;

impl RecentCopies {
    /// A copy read from ring `ring` (one for a user allocation, which nothing refers to,
    /// or a stack record without a copy, is passed over).
    pub fn seen(&mut self, ring: usize, stack: &StackRecord) {
        let Some(miss) = stack.miss.as_ref().filter(|_| stack.joined_kernel) else { return };
        if self.rings.len() <= ring {
            self.rings.resize_with(ring + 1, Default::default);
        }
        let recent = &mut self.rings[ring];
        if recent.len() == RECENT_PER_RING {
            recent.pop_front();
        }
        recent.push_back((stack.hash, miss.clone()));
    }

    /// A stack read from ring `ring` whose user part is that of copy `of`: given that
    /// copy, to be finished as one; cut short where it went after the copy was read (a
    /// copy lost or not decoded).
    pub fn resolve(&mut self, ring: usize, mut stack: StackRecord, of: u64) -> StackRecord {
        let found = self.rings.get(ring).and_then(|r| r.iter().rev().find(|(hash, _)| *hash == of));
        match found {
            Some((_, miss)) => {
                self.matched += 1;
                stack.miss = Some(miss.clone());
            }
            None => {
                self.unmatched += 1;
                stack.truncated = true;
            }
        }
        stack
    }
}

/// A hash of everything a finished stack shows: its process, kernel and user frames, how
/// it ended, its Python frames.
fn content_hash(s: &StackRecord) -> u64 {
    let mut h = stack_hash_step(CONTENT_SEED, u64::from(s.pid));
    let flags = u64::from(s.truncated) | u64::from(s.joined_kernel) << 1 | (s.walk as u64) << 2;
    h = stack_hash_step(h, flags);
    h = stack_hash_step(h, s.kernel.len() as u64);
    for &ip in &s.kernel {
        h = stack_hash_step(h, ip);
    }
    h = stack_hash_step(h, s.user.len() as u64);
    for f in &s.user {
        h = match *f {
            RawUserFrame::Ip(ip) => stack_hash_step(h, ip),
            RawUserFrame::BuildId { build_id, offset } => {
                let mut h = stack_hash_step(h, offset ^ (1 << 63));
                for part in build_id.chunks(8) {
                    let mut word = [0u8; 8];
                    word[..part.len()].copy_from_slice(part);
                    h = stack_hash_step(h, u64::from_le_bytes(word));
                }
                h
            }
        };
    }
    // Its Python frames as named (the raw frames are not kept once named).
    let names = s.python_context.as_ref().map_or(&[][..], |c| &c.names[..]);
    h = stack_hash_step(h, names.len() as u64);
    for n in names {
        let text = |t: &str| {
            let mut hasher = std::hash::DefaultHasher::new();
            std::hash::Hash::hash(t, &mut hasher);
            std::hash::Hasher::finish(&hasher)
        };
        h = stack_hash_step(stack_hash_step(h, text(&n.function.qualname)), text(&n.function.filename));
        h = stack_hash_step(h, u64::from(n.line) | u64::from(n.group_end) << 32);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::UserWalk;

    /// A reference finds its copy among its ring's last ones, not another ring's; one
    /// whose copy is gone is cut short rather than left waiting.
    #[test]
    fn a_reference_is_finished_with_its_rings_copy() {
        let mut with_copy = copy(7, &[0x40_1000]);
        with_copy.joined_kernel = true;
        with_copy.miss = Some(Box::new(StackMiss {
            ip: 0x40_1000,
            sp: 0x7ffc_0000,
            bp: 0,
            returns: Vec::new(),
            asid: 3,
            exact: true,
            copy: vec![1, 2, 3],
            resume_at: 0,
            resume_sps: Default::default(),
            resume_bps: Default::default(),
            bp_used: 0,
        }));
        let mut recent = RecentCopies::default();
        recent.seen(1, &with_copy);
        for other in 100..100 + RECENT_PER_RING as u64 - 1 {
            let mut c = with_copy.clone();
            c.hash = other;
            recent.seen(1, &c);
        }
        let finished = recent.resolve(1, copy(8, &[0x40_1000]), 7);
        assert_eq!(finished.miss.as_ref().map(|m| m.copy.clone()), Some(vec![1, 2, 3]));
        assert!(!finished.truncated);
        let elsewhere = recent.resolve(0, copy(9, &[0x40_1000]), 7);
        assert!(elsewhere.miss.is_none() && elsewhere.truncated, "another ring's copy");
        let mut c = with_copy.clone();
        c.hash = 200;
        recent.seen(1, &c);
        let gone = recent.resolve(1, copy(10, &[0x40_1000]), 7);
        assert!(gone.miss.is_none() && gone.truncated, "pushed out by later copies");
        assert_eq!((recent.matched, recent.unmatched), (1, 2));
    }

    fn copy(hash: u64, user: &[u64]) -> StackRecord {
        StackRecord {
            hash,
            pid: 7,
            kernel: Vec::new(),
            user: user.iter().map(|&ip| RawUserFrame::Ip(ip)).collect(),
            walk: UserWalk::CallFrameInfo,
            truncated: false,
            no_room: false,
            joined_kernel: false,
            miss: None,
            asid: 1,
            python_context: None,
            py_key: 0,
        }
    }

    #[test]
    fn copies_of_one_stack_become_one_and_their_allocations_follow() {
        let mut c = CopyNames::default();
        let first = c.finished(copy(101, &[1, 2, 3])).expect("the first is delivered");
        assert_ne!(first.hash, 101);
        assert!(c.finished(copy(102, &[1, 2, 3])).is_none(), "the same content once");
        let other = c.finished(copy(103, &[1, 2, 4])).expect("other content");
        assert_ne!(other.hash, first.hash);
        assert_eq!(c.released(101), first.hash);
        assert_eq!(c.released(102), first.hash);
        assert_eq!(c.released(103), other.hash);
        assert_eq!(c.merged, 1);
        // A hash no copy had is left alone, and the renames are forgotten once used.
        assert_eq!(c.released(55), 55);
        assert_eq!(c.released(101), 101);
    }

    #[test]
    fn an_allocation_released_before_its_copy_is_finished_keeps_the_copys_hash() {
        let mut c = CopyNames::default();
        c.waiting(201);
        assert_eq!(c.released(201), 201);
        let s = c.finished(copy(201, &[1, 2, 3])).expect("delivered");
        assert_eq!(s.hash, 201, "under the hash its allocation went out with");
        // A later copy of the same content is still named by content.
        let t = c.finished(copy(202, &[1, 2, 3])).expect("the content was not delivered");
        assert_ne!(t.hash, 202);
        assert_eq!(c.released(202), t.hash);
    }

    #[test]
    fn what_a_stack_shows_tells_contents_apart() {
        let base = copy(1, &[1, 2, 3]);
        let mut truncated = base.clone();
        truncated.truncated = true;
        let mut kernel = base.clone();
        kernel.kernel = vec![9];
        let mut other_pid = base.clone();
        other_pid.pid = 8;
        let with_python = |line: u32, group_end: bool| {
            let mut s = base.clone();
            let function = crate::python::code::PyFunction::new("run", "/app/job.py");
            s.python_context = Some(std::sync::Arc::new(crate::python::PythonContext {
                names: vec![crate::python::Named::new(function, line, group_end)],
                interpreter: "/usr/bin/python3".into(),
                eval: Vec::new(),
            }));
            s
        };
        let (python, other_line, other_group) = (with_python(3, false), with_python(4, false), with_python(3, true));
        let hashes: std::collections::HashSet<u64> =
            [&base, &truncated, &kernel, &other_pid, &python, &other_line, &other_group].map(content_hash).into();
        assert_eq!(hashes.len(), 7);
        assert_eq!(content_hash(&python), content_hash(&with_python(3, false)), "names, not their pointers");
        let mut same = base.clone();
        same.hash = 99;
        assert_eq!(content_hash(&same), content_hash(&base), "the probes' hash is not content");
    }
}
