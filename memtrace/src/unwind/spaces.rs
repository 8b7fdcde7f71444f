//! Address spaces, as the unwinder needs them: which file each executable range of a
//! process maps, at which bias, and that file's table slot. Learned from what the probes
//! report (a new address space at each exec, shared by a forked child; each executable
//! mapping as the kernel makes it) and, for processes that existed before tracing began,
//! from `/proc/PID/maps`. Every range is mirrored in the probes' LPM trie (split into
//! aligned prefixes) so the probes find a frame's file with one lookup; the ranges of an
//! address space no process uses any more leave the trie but stay here a while, to name the
//! frames of events still on their way.
//!
//! A fork, exec or exit older than what is known of its process (read a drain late, from
//! another CPU's ring) is refused (`crate::lifecycle`): a late fork must not pull an exec'd
//! child back into its parent's space, which emptied the new space's ranges out of the
//! probes for the child's whole life.
use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::Arc,
};

use memtrace_common::{MappingKey, MappingValue, unwind::mapping_flags};

use super::{
    cfi::{Segment, vaddr_of_file_offset},
    store::{Slot, TableSink, TableStore},
};
use crate::{
    at_start::{Snapshot, StartView},
    lifecycle::Lifecycles,
    procfs::{self, Maps},
};

/// Where the probes' address-space state goes (the session's `Probes`; a fake in tests).
pub trait SpaceSink: TableSink {
    /// Sets the address space of `pid`; with `only_if_absent`, keeps one the kernel
    /// already gave it and returns that. Returns the id in force.
    fn set_asid(&mut self, pid: u32, asid: u32, only_if_absent: bool) -> anyhow::Result<u32>;
    fn insert_mapping(&mut self, key: MappingKey, prefix_bits: u32, value: MappingValue) -> anyhow::Result<()>;
    fn remove_mapping(&mut self, key: MappingKey, prefix_bits: u32) -> anyhow::Result<()>;
    /// Takes `pid`'s address space out of the probes if it is still `asid`.
    fn remove_asid(&mut self, _pid: u32, _asid: u32) -> anyhow::Result<()> {
        Ok(())
    }
    /// A live space's range now holds another file (or the same at another bias): rules
    /// the probes cached for its addresses are stale.
    fn ranges_replaced(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
    /// What the probes find at `addr` of `asid` (for diagnostics).
    fn lookup_mapping(&self, _asid: u32, _addr: u64) -> Option<MappingValue> {
        None
    }
}

/// One executable range of an address space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// The file (a path this process can open), None for code without a file.
    pub path: Option<PathBuf>,
    /// File offset of `start`.
    pub file_offset: u64,
    /// `vaddr = addr - bias`, for the file's table.
    pub bias: u64,
    pub slot: Option<Slot>,
    /// The file's build id, once a frame in it was named (`Unwinder::named`): asked per
    /// frame, not hashed by path each time.
    pub build_id: std::cell::OnceCell<Option<[u8; 20]>>,
}

impl Mapping {
    /// The file offset of an address in this mapping.
    pub fn file_offset_of(&self, addr: u64) -> u64 {
        addr - self.start + self.file_offset
    }
}

#[derive(Default)]
struct Space {
    /// Sorted by start, not overlapping.
    mappings: Vec<Mapping>,
    /// Processes in it.
    pids: u32,
}

/// Address spaces of exited processes kept for naming late events.
const DEAD_SPACES_KEPT: usize = 1024;
/// First spaces remembered (a few MB of copies wait at most a few seconds).
const FIRST_SPACES_KEPT: usize = 4096;
/// Userspace's address-space ids (for processes that existed before tracing began).
const USER_ASID_BASE: u32 = 1 << 31;

/// Whether `asid` is one userspace gave (to a process learned from `/proc`), not the
/// kernel at an exec.
pub fn is_learned(asid: u32) -> bool {
    asid >= USER_ASID_BASE
}

#[derive(Default)]
pub struct Spaces {
    asid_of: crate::FastMap<u32, u32>,
    spaces: crate::FastMap<u32, Space>,
    dead: VecDeque<u32>,
    /// Spaces emptied since the last [`Spaces::take_emptied`] (an exec leaves its old
    /// space as an exit does), for what the unwinder keeps per space.
    emptied: Vec<u32>,
    /// pid → the space a stack the probes took before they knew any space of the process
    /// was taken in, even if it is finished after the process's exec or exit: the one it
    /// was forked into (the child of a process running before tracing began), or what the
    /// session's snapshot showed (a process running before tracing began that exec'd
    /// before its first stack was walked). The latest [`FIRST_SPACES_KEPT`], oldest first
    /// in `first_order`.
    first_space: crate::FastMap<u32, u32>,
    first_order: VecDeque<u32>,
    /// Which task records are news.
    order: Lifecycles,
    next_user_asid: u32,
    /// The processes running when the session began, as they were then (`record -a`).
    at_start: StartView,
}

/// The aligned prefixes that cover `[start, end)`: (first address, bits of the address
/// that are fixed).
pub fn prefixes(start: u64, end: u64) -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let mut size_log = at.trailing_zeros().min(63);
        while size_log > 0 && at.checked_add(1 << size_log).is_none_or(|e| e > end) {
            size_log -= 1;
        }
        out.push((at, 64 - size_log));
        match at.checked_add(1 << size_log) {
            Some(next) => at = next,
            None => break,
        }
    }
    out
}

impl Spaces {
    pub fn new() -> Self {
        Self { next_user_asid: USER_ASID_BASE, ..Default::default() }
    }

    /// Whether address space `asid` is known here (a process was seen in it, alive or not).
    pub fn knows(&self, asid: u32) -> bool {
        self.spaces.contains_key(&asid)
    }

    pub fn asid_of(&self, pid: u32) -> Option<u32> {
        self.asid_of.get(&pid).copied()
    }

    /// The space `pid`'s stacks taken before the probes knew it ran in (see the field),
    /// whatever it runs in now.
    pub fn first_space(&self, pid: u32) -> Option<u32> {
        self.first_space.get(&pid).copied()
    }

    /// Task records handled after a later one of their process and left out.
    pub fn late_records(&self) -> u64 {
        self.order.late()
    }

    fn join(&mut self, pid: u32, asid: u32, sink: &mut dyn SpaceSink) {
        if let Some(old) = self.asid_of.insert(pid, asid) {
            if old == asid {
                return;
            }
            self.leave(old, sink);
        }
        self.spaces.entry(asid).or_default().pids += 1;
    }

    /// One process fewer in `asid`; returns whether that was its last.
    fn leave(&mut self, asid: u32, sink: &mut dyn SpaceSink) -> bool {
        let Some(space) = self.spaces.get_mut(&asid) else { return false };
        space.pids = space.pids.saturating_sub(1);
        if space.pids > 0 {
            return false;
        }
        // Nobody runs in it any more: the probes forget it; its ranges stay here a while.
        for m in &space.mappings {
            remove_entries(asid, m, sink);
        }
        self.bury(asid);
        self.emptied.push(asid);
        true
    }

    /// Whether a process runs in `asid`.
    pub fn in_use(&self, asid: u32) -> bool {
        self.spaces.get(&asid).is_some_and(|s| s.pids > 0)
    }

    /// The spaces the last process left (by exit, exec or a reused pid's fork) since the
    /// last call.
    pub fn take_emptied(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.emptied)
    }

    /// Marks `asid`, which no process uses, dead: kept a while for naming, never again in
    /// the probes.
    fn bury(&mut self, asid: u32) {
        self.dead.push_back(asid);
        while self.dead.len() > DEAD_SPACES_KEPT {
            if let Some(old) = self.dead.pop_front()
                && self.spaces.get(&old).is_some_and(|s| s.pids == 0)
            {
                self.spaces.remove(&old);
            }
        }
    }

    /// `pid` exec'd into address space `asid` (given by the kernel) at `ts_ns`. Returns
    /// whether a process runs in that space: the exec is news, or it was read late but the
    /// process was learned in it from `/proc` meanwhile. An exec read after the process's
    /// exit (or a later exec) leaves its space dead: its ranges name late frames, and what
    /// the probes installed there themselves leaves them as the ranges are learned.
    pub fn learn_exec(&mut self, pid: u32, asid: u32, ts_ns: u64, sink: &mut dyn SpaceSink) -> bool {
        if asid == 0 {
            return true;
        }
        if self.order.began(pid, ts_ns) {
            self.at_start.changed(pid);
            self.join(pid, asid, sink);
            return true;
        }
        let space = self.spaces.entry(asid).or_default();
        if space.pids > 0 {
            return true;
        }
        if !self.dead.contains(&asid) {
            // Its mappings read in an earlier drain went into the probes.
            for m in &space.mappings {
                remove_entries(asid, m, sink);
            }
            self.bury(asid);
        }
        false
    }

    /// `child` was forked into its parent's address space `asid` at `ts_ns`. Returns
    /// whether that is news.
    ///
    /// A fork read after the child's exec (its parent's CPU's ring drained later than the
    /// child's) is not news: the child runs in its exec's space. Its stacks taken before
    /// the exec, in a space the probes did not know, still ran in the parent's: that is
    /// remembered for them (not for a fork older than the pid's last exit: another
    /// process's).
    pub fn learn_fork(&mut self, child: u32, asid: u32, ts_ns: u64, sink: &mut dyn SpaceSink) -> bool {
        if !self.order.began(child, ts_ns) {
            if asid != 0 && !self.order.exited_since(child, ts_ns) && !self.first_space.contains_key(&child) {
                self.remember_first_space(child, asid);
            }
            return false;
        }
        self.at_start.changed(child);
        if asid != 0 {
            self.join(child, asid, sink);
            self.remember_first_space(child, asid);
        } else if self.first_space.remove(&child).is_some() {
            self.first_order.retain(|&p| p != child);
        }
        true
    }

    fn remember_first_space(&mut self, child: u32, asid: u32) {
        if self.first_space.insert(child, asid).is_none() {
            self.first_order.push_back(child);
            while self.first_order.len() > FIRST_SPACES_KEPT {
                if let Some(old) = self.first_order.pop_front() {
                    self.first_space.remove(&old);
                }
            }
        }
    }

    /// `pid` exited at `ts_ns`. Returns the address space it was the last process of.
    pub fn learn_exit(&mut self, pid: u32, ts_ns: u64, sink: &mut dyn SpaceSink) -> Option<u32> {
        if !self.order.ended(pid, ts_ns) {
            return None;
        }
        self.at_start.changed(pid);
        let asid = self.asid_of.remove(&pid)?;
        // Learned here: the copies the probes took before they had it (asid 0), finished
        // after this exit (waiting for a table), are walked there still.
        if is_learned(asid) && !self.first_space.contains_key(&pid) {
            self.remember_first_space(pid, asid);
        }
        self.leave(asid, sink).then_some(asid)
    }

    /// An executable mapping the kernel made in `asid` (`path` readable from here, None
    /// for code without a file).
    #[allow(clippy::too_many_arguments)]
    pub fn add_mapping(
        &mut self,
        asid: u32,
        start: u64,
        len: u64,
        file_offset: u64,
        path: Option<&Path>,
        store: &mut TableStore,
        sink: &mut dyn SpaceSink,
    ) {
        if asid == 0 || len == 0 {
            return;
        }
        let file = path.and_then(|p| store.request(p).map(|(slot, segments)| (p.to_path_buf(), slot, segments)));
        let (path, slot, bias) = match file {
            Some((path, slot, segments)) => {
                let bias = bias_of(&segments, start, file_offset);
                (Some(path), Some(slot), bias)
            }
            None => (None, None, 0),
        };
        let mapping = Mapping {
            start,
            end: start.saturating_add(len),
            path,
            file_offset,
            bias,
            slot,
            build_id: Default::default(),
        };
        let buried = self.dead.contains(&asid);
        let space = self.spaces.entry(asid).or_default();
        let in_probes = space.pids > 0 || !buried;
        // What the new range covers is unmapped (the kernel replaced it).
        let mut kept = Vec::with_capacity(space.mappings.len() + 1);
        let mut replaced = false;
        for m in space.mappings.drain(..) {
            if m.end <= mapping.start || m.start >= mapping.end {
                kept.push(m);
            } else if in_probes {
                replaced |= m.slot != mapping.slot || m.bias != mapping.bias;
                remove_entries(asid, &m, sink);
            }
        }
        if replaced && let Err(e) = sink.ranges_replaced() {
            log::debug!("the probes' rule cache not told of a replaced range: {e:#}");
        }
        let at = kept.partition_point(|m| m.start < mapping.start);
        if in_probes {
            insert_entries(asid, &mapping, sink);
        } else {
            // A dead space: what the probes installed there themselves (at an exec or an
            // mmap read after the process's exit) leaves them.
            remove_entries(asid, &mapping, sink);
        }
        kept.insert(at, mapping);
        space.mappings = kept;
    }

    /// Takes `[start, end)` of `asid` out of the probes (ranges they installed themselves in
    /// a space that turned out dead).
    pub fn forget_range(&mut self, asid: u32, start: u64, end: u64, sink: &mut dyn SpaceSink) {
        if self.spaces.get(&asid).is_none_or(|s| s.pids == 0) {
            remove_range(asid, start, end, sink);
        }
    }

    /// `pid` exec'd at `ts_ns`: the copies the probes took of it while they knew no space
    /// of it were taken before, in the space it ran then, whatever it runs when they are
    /// walked. That is the one this side learned it in (from `/proc` or the session's
    /// snapshot; the probes had it from then on), or, for a process running when the
    /// session began that nothing made learned yet, what the snapshot shows (read before the
    /// exec): learned into a space of its own, dead from the start (no process joins it, the
    /// probes never have it). `/proc`, and the exec's space, show the new program.
    pub fn learn_before_exec(&mut self, pid: u32, ts_ns: u64, store: &mut TableStore, sink: &mut dyn SpaceSink) {
        if self.first_space.contains_key(&pid) {
            return;
        }
        let before = match self.asid_of(pid) {
            Some(asid) if is_learned(asid) => asid,
            // The kernel's: the probes stamped every stack of it with it.
            Some(_) => return,
            None => {
                let Some((maps, _)) = self.at_start.take_maps(pid).filter(|&(_, read_ns)| read_ns < ts_ns) else {
                    return;
                };
                let asid = self.next_user_asid;
                self.next_user_asid = self.next_user_asid.wrapping_add(1) | USER_ASID_BASE;
                self.spaces.entry(asid).or_default();
                self.bury(asid);
                self.add_maps(asid, pid, &maps, store, sink);
                asid
            }
        };
        self.remember_first_space(pid, before);
    }

    /// The processes running when the session began, as they were then: what
    /// [`Self::learn_process`] takes for them until they change.
    pub fn set_at_start(&mut self, snapshot: Arc<Snapshot>) {
        self.at_start = StartView::new(snapshot);
    }

    /// Learns a process that existed before tracing began (or whose address space was
    /// not seen being made): from the session's snapshot of it while that holds, else from
    /// `/proc/PID/maps`. Returns its address space.
    pub fn learn_process(&mut self, pid: u32, store: &mut TableStore, sink: &mut dyn SpaceSink) -> Option<u32> {
        if let Some(asid) = self.asid_of(pid)
            && self.spaces.get(&asid).is_some_and(|s| !s.mappings.is_empty())
        {
            return Some(asid);
        }
        // What /proc shows (the snapshot showed) is later than any record of the process
        // made before it was read.
        let (maps, seen) = match self.at_start.take_maps(pid) {
            Some(found) => found,
            None => {
                let seen = crate::session::monotonic_ns();
                (Maps::read(pid).ok()?, seen)
            }
        };
        if !maps.mappings.iter().any(|m| m.executable) {
            return None; // a kernel thread, a zombie: nothing to walk
        }
        let proposed = self.next_user_asid;
        let asid = sink.set_asid(pid, proposed, true).ok()?;
        if asid == proposed {
            self.next_user_asid = self.next_user_asid.wrapping_add(1) | USER_ASID_BASE;
        }
        self.order.seen_alive(pid, seen);
        self.join(pid, asid, sink);
        self.add_maps(asid, pid, &maps, store, sink);
        Some(asid)
    }

    /// The executable mappings of process `pid`'s `maps`, into `asid`.
    fn add_maps(&mut self, asid: u32, pid: u32, maps: &Maps, store: &mut TableStore, sink: &mut dyn SpaceSink) {
        for m in maps.mappings.iter().filter(|m| m.executable) {
            let path = m.is_file().then(|| procfs::path_in_process(pid, &m.path));
            self.add_mapping(asid, m.start, m.end - m.start, m.offset, path.as_deref(), store, sink);
        }
    }

    /// The mapping of `addr` in `asid`.
    pub fn find(&self, asid: u32, addr: u64) -> Option<&Mapping> {
        let space = self.spaces.get(&asid)?;
        let at = space.mappings.partition_point(|m| m.start <= addr);
        space.mappings[..at].last().filter(|m| addr < m.end)
    }

    /// The range to record for memory `[start, end)` of `asid` made executable by
    /// `mprotect`: None when it is known already (a file's pages, which keep what their
    /// file says, or memory without a file that covers it all: a JIT switching its pages
    /// between writable and executable); else the range joined with the ranges of memory
    /// without a file it overlaps, which recording it alone would cut.
    pub fn protected_range(&self, asid: u32, start: u64, end: u64) -> Option<(u64, u64)> {
        let Some(space) = self.spaces.get(&asid) else { return Some((start, end)) };
        let from = space.mappings.partition_point(|m| m.end <= start);
        let (mut lo, mut hi) = (start, end);
        for m in space.mappings[from..].iter().take_while(|m| m.start < end) {
            if m.path.is_some() || (m.start <= start && end <= m.end) {
                return None;
            }
            lo = lo.min(m.start);
            hi = hi.max(m.end);
        }
        Some((lo, hi))
    }

    /// The executable file mappings of `asid` as a memory map, for naming frames by file
    /// and offset after the process is gone (its `/proc` maps with it).
    pub fn file_maps(&self, asid: u32) -> Option<Maps> {
        let space = self.spaces.get(&asid)?;
        let mappings = space
            .mappings
            .iter()
            .filter_map(|m| {
                Some(procfs::Mapping {
                    start: m.start,
                    end: m.end,
                    executable: true,
                    offset: m.file_offset,
                    // Not known here; any non-zero value marks a file.
                    inode: 1,
                    path: m.path.clone()?,
                    deleted: false,
                })
            })
            .collect();
        Some(Maps { mappings })
    }

    /// Executable ranges known in `asid`.
    pub fn mapping_count(&self, asid: u32) -> usize {
        self.spaces.get(&asid).map_or(0, |s| s.mappings.len())
    }

    /// Processes (by address space) currently known.
    pub fn live_spaces(&self) -> usize {
        self.spaces.values().filter(|s| s.pids > 0).count()
    }
}

/// `vaddr = addr - bias` for a mapping at `start` of the file offset `file_offset`.
fn bias_of(segments: &Arc<[Segment]>, start: u64, file_offset: u64) -> u64 {
    match vaddr_of_file_offset(segments, file_offset) {
        Some(vaddr) => start.wrapping_sub(vaddr),
        // An offset in no loadable segment: take the file as mapped from 0.
        None => start.wrapping_sub(file_offset),
    }
}

fn value_of(m: &Mapping) -> MappingValue {
    let flags = match (&m.path, m.slot) {
        (None, _) => mapping_flags::NO_FILE,
        (Some(_), None) => mapping_flags::NO_TABLE,
        _ => 0,
    };
    MappingValue { table: m.slot.unwrap_or(0), flags, start: m.start, end: m.end, bias: m.bias }
}

fn insert_entries(asid: u32, m: &Mapping, sink: &mut dyn SpaceSink) {
    let value = value_of(m);
    for (addr, bits) in prefixes(m.start, m.end) {
        if let Err(e) = sink.insert_mapping(MappingKey::new(asid, addr), MappingKey::ASID_BITS + bits, value) {
            log::debug!("installing a mapping of address space {asid}: {e:#}");
            return;
        }
    }
}

fn remove_entries(asid: u32, m: &Mapping, sink: &mut dyn SpaceSink) {
    remove_range(asid, m.start, m.end, sink);
}

fn remove_range(asid: u32, start: u64, end: u64, sink: &mut dyn SpaceSink) {
    for (addr, bits) in prefixes(start, end) {
        let _ = sink.remove_mapping(MappingKey::new(asid, addr), MappingKey::ASID_BITS + bits);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// The probes' side, in memory: the LPM trie answered by longest prefix.
    #[derive(Default)]
    pub(crate) struct FakeProbes {
        pub asids: std::collections::HashMap<u32, u32>,
        pub trie: BTreeMap<(u32, u64, u32), MappingValue>,
        pub tables: Vec<(Slot, usize)>,
        /// Times the rule cache was told a range was replaced.
        pub replaced: u32,
    }

    impl TableSink for FakeProbes {
        fn install_tables(
            &mut self,
            tables: &[(Slot, &crate::unwind::table::Table)],
        ) -> Vec<crate::unwind::store::InstallResult> {
            self.tables.extend(tables.iter().map(|(slot, table)| (*slot, table.elements().len())));
            tables.iter().map(|_| Ok(None)).collect()
        }
    }

    impl SpaceSink for FakeProbes {
        fn set_asid(&mut self, pid: u32, asid: u32, only_if_absent: bool) -> anyhow::Result<u32> {
            if only_if_absent && let Some(&a) = self.asids.get(&pid) {
                return Ok(a);
            }
            self.asids.insert(pid, asid);
            Ok(asid)
        }
        fn ranges_replaced(&mut self) -> anyhow::Result<()> {
            self.replaced += 1;
            Ok(())
        }
        fn remove_asid(&mut self, pid: u32, asid: u32) -> anyhow::Result<()> {
            if self.asids.get(&pid) == Some(&asid) {
                self.asids.remove(&pid);
            }
            Ok(())
        }
        fn insert_mapping(&mut self, key: MappingKey, bits: u32, value: MappingValue) -> anyhow::Result<()> {
            let asid = u32::from_be_bytes(key.asid);
            self.trie.insert((asid, u64::from_be_bytes(key.addr), bits), value);
            Ok(())
        }
        fn remove_mapping(&mut self, key: MappingKey, bits: u32) -> anyhow::Result<()> {
            let asid = u32::from_be_bytes(key.asid);
            self.trie.remove(&(asid, u64::from_be_bytes(key.addr), bits));
            Ok(())
        }
    }

    impl FakeProbes {
        /// Longest-prefix match, as the kernel's trie answers.
        pub fn lookup(&self, asid: u32, addr: u64) -> Option<MappingValue> {
            self.trie
                .iter()
                .filter(|((a, start, bits), _)| {
                    let addr_bits = bits - MappingKey::ASID_BITS;
                    let mask = if addr_bits == 0 { 0 } else { u64::MAX << (64 - addr_bits) };
                    *a == asid && addr & mask == *start
                })
                .max_by_key(|((_, _, bits), _)| *bits)
                .map(|(_, v)| *v)
        }
    }

    proptest! {
        #[test]
        fn prefixes_cover_a_range_exactly(start in 0u64..(1 << 47), len in 1u64..(1 << 36)) {
            let end = start + len;
            let ps = prefixes(start, end);
            prop_assert!(ps.len() <= 128);
            let mut at = start;
            for (addr, bits) in ps {
                prop_assert_eq!(addr, at);
                let size = 1u64 << (64 - bits);
                prop_assert_eq!(addr % size, 0, "aligned");
                at += size;
            }
            prop_assert_eq!(at, end);
        }
    }

    #[test]
    fn a_process_is_learned_from_its_maps_and_its_code_found_by_prefix() {
        let pid = std::process::id();
        let mut spaces = Spaces::new();
        let mut store = TableStore::new(None, 1, super::super::store::DEFAULT_MAX_BYTES);
        let mut probes = FakeProbes::default();
        let asid = spaces.learn_process(pid, &mut store, &mut probes).unwrap();
        assert!(asid >= USER_ASID_BASE);
        assert_eq!(probes.asids[&pid], asid);
        let here = a_function as *const () as u64;
        let m = spaces.find(asid, here).unwrap().clone();
        let v = probes.lookup(asid, here).unwrap();
        assert_eq!((v.start, v.end, v.bias, v.flags), (m.start, m.end, m.bias, 0));
        // The mapping's bias turns the address into the executable's own virtual address.
        let table_vaddr = here - m.bias;
        let exe_vaddr = store.identify(m.path.as_deref().unwrap()).unwrap().1.iter().find_map(|s| {
            let fo = m.file_offset_of(here);
            (s.file_offset <= fo && fo < s.file_offset + s.file_size).then(|| fo - s.file_offset + s.vaddr)
        });
        assert_eq!(Some(table_vaddr), exe_vaddr);
        // Another address space sees nothing there.
        assert!(probes.lookup(asid + 1, here).is_none());
        // Leaving empties the trie but keeps the ranges for naming.
        spaces.learn_exit(pid, crate::session::monotonic_ns(), &mut probes);
        assert!(probes.trie.is_empty());
        assert!(spaces.find(asid, here).is_some());
    }

    #[inline(never)]
    fn a_function() -> u64 {
        std::hint::black_box(7)
    }

    #[test]
    fn a_new_mapping_replaces_what_it_covers() {
        let mut spaces = Spaces::new();
        let mut store = TableStore::new(None, 1, super::super::store::DEFAULT_MAX_BYTES);
        let mut probes = FakeProbes::default();
        spaces.learn_exec(1, 5, 10, &mut probes);
        spaces.add_mapping(5, 0x10000, 0x10000, 0, None, &mut store, &mut probes);
        assert_eq!(probes.lookup(5, 0x18000).unwrap().flags, mapping_flags::NO_FILE);
        assert_eq!(probes.replaced, 0);
        spaces.add_mapping(5, 0x18000, 0x1000, 0, None, &mut store, &mut probes);
        assert_eq!(spaces.find(5, 0x18000).unwrap().start, 0x18000);
        assert_eq!(probes.replaced, 0, "code without a file over the same: no rule the probes cached differs");
        assert!(spaces.find(5, 0x10000).is_none(), "the old range is gone");
        // A file's code over it (a library mapped where another was): the rules cached
        // for those addresses are stale.
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        spaces.add_mapping(5, 0x18000, 0x1000, 0, Some(&exe), &mut store, &mut probes);
        assert_eq!(probes.replaced, 1);
        assert!(probes.lookup(5, 0x10000).is_none());
        // A forked child shares the space: it stays in the trie until both are gone.
        spaces.learn_fork(2, 5, 20, &mut probes);
        spaces.learn_exit(1, 30, &mut probes);
        assert!(probes.lookup(5, 0x18000).is_some());
        spaces.learn_exit(2, 40, &mut probes);
        assert!(probes.lookup(5, 0x18000).is_none());
        // Where the child was forked stays known after its exit: its copies taken before the
        // probes knew a space of it (asid 0) are finished later, in that space's ranges.
        assert_eq!((spaces.first_space(2), spaces.asid_of(2)), (Some(5), None));
        assert_eq!(spaces.find(5, 0x18000).map(|m| m.start), Some(0x18000));
    }

    /// A process running when the session began (`record -a`) is learned from the
    /// session's snapshot, not from what its `/proc` shows when its first copy is read: by
    /// then it may have exec'd (a shell's last command), and its stacks from before were
    /// walked in that program's maps. An exec of it read before any of it was learned
    /// leaves its copies from before a space of their own, from the snapshot.
    #[test]
    fn a_process_running_at_the_start_is_learned_as_it_was_then() {
        use crate::{
            at_start::{Process, Snapshot},
            procfs::{Mapping, Maps},
        };
        let code = |start: u64| Mapping {
            start,
            end: start + 0x1000,
            executable: true,
            offset: 0,
            inode: 0,
            path: PathBuf::new(),
            deleted: false,
        };
        // Pids far above any live one: /proc has nothing of them.
        let (shell, other, third) = (u32::MAX - 10, u32::MAX - 11, u32::MAX - 12);
        let process = |start| Process { maps: Maps { mappings: vec![code(start)] }, comm: "bash".into(), read_ns: 100 };
        let snapshot = Snapshot::of([(shell, process(0x10000)), (other, process(0x30000)), (third, process(0x50000))]);
        assert_eq!(snapshot.comm(shell), Some("bash"));
        let mut spaces = Spaces::new();
        spaces.set_at_start(Arc::new(snapshot));
        let mut store = TableStore::new(None, 1, super::super::store::DEFAULT_MAX_BYTES);
        let mut probes = FakeProbes::default();
        let asid = spaces.learn_process(other, &mut store, &mut probes).unwrap();
        assert!(is_learned(asid) && spaces.find(asid, 0x30000).is_some());
        // Its exec at 200: the copies the probes took before it (asid 0) were taken in the
        // space it was learned in.
        spaces.learn_before_exec(other, 200, &mut store, &mut probes);
        assert_eq!(spaces.first_space(other), Some(asid));
        // One that exits: its copies finished after (waiting for a table) are walked where
        // it was learned.
        let learned = spaces.learn_process(third, &mut store, &mut probes).unwrap();
        assert_eq!(spaces.learn_exit(third, 400, &mut probes), Some(learned));
        assert_eq!((spaces.first_space(third), spaces.asid_of(third)), (Some(learned), None));
        assert!(spaces.find(learned, 0x50000).is_some());
        // The shell, never learned, execs at 300: its space from before is the snapshot's,
        // dead (the probes never have it).
        spaces.learn_before_exec(shell, 300, &mut store, &mut probes);
        let before = spaces.first_space(shell).unwrap();
        assert!(spaces.find(before, 0x10000).is_some());
        assert!(probes.lookup(before, 0x10000).is_none());
        assert!(spaces.learn_exec(shell, 7, 300, &mut probes));
        assert_eq!(spaces.asid_of(shell), Some(7));
        // Taken once: after the exec, the snapshot no longer says what the shell is.
        assert!(spaces.learn_process(shell, &mut store, &mut probes).is_none_or(|a| a == 7));
        // An exec older than the snapshot's read: the snapshot shows the new program.
        let mut spaces = Spaces::new();
        spaces.set_at_start(Arc::new(Snapshot::of([(shell, process(0x10000))])));
        spaces.learn_before_exec(shell, 50, &mut store, &mut probes);
        assert_eq!(spaces.first_space(shell), None);
    }

    /// Task records come in the order the rings are read: a child's exec (its CPU's ring)
    /// may be handled before its parent's fork (another ring). The late fork must not move
    /// the child back into the parent's space, which took the exec's ranges out of the
    /// probes for the child's whole life (every stack a copy); a late exec or fork of a
    /// process whose exit came first must not bring it back.
    #[test]
    fn task_records_handled_out_of_order_keep_the_newest_space() {
        let mut spaces = Spaces::new();
        let mut store = TableStore::new(None, 1, super::super::store::DEFAULT_MAX_BYTES);
        let mut probes = FakeProbes::default();
        // The parent (pid 1) runs in space 5; it forks pid 2 at 100, which execs into
        // space 7 at 200 and maps its code there; the exec is handled first.
        assert!(spaces.learn_exec(1, 5, 10, &mut probes));
        spaces.add_mapping(5, 0x10000, 0x1000, 0, None, &mut store, &mut probes);
        assert!(spaces.learn_exec(2, 7, 200, &mut probes));
        spaces.add_mapping(7, 0x40000, 0x1000, 0, None, &mut store, &mut probes);
        assert!(!spaces.learn_fork(2, 5, 100, &mut probes));
        assert_eq!(spaces.asid_of(2), Some(7));
        // Its stacks taken before the exec, in a space the probes did not know, are walked
        // in the parent's (a subshell's child under -a: every frame `[unknown]` before).
        assert_eq!(spaces.first_space(2), Some(5));
        assert!(probes.lookup(7, 0x40000).is_some(), "the child's code stays in the probes");
        spaces.add_mapping(7, 0x50000, 0x1000, 0, None, &mut store, &mut probes);
        assert!(probes.lookup(7, 0x50000).is_some(), "and so does what it maps next");
        // The parent's exit empties its space (the child never counted in it).
        assert_eq!(spaces.learn_exit(1, 300, &mut probes), Some(5));
        assert!(probes.lookup(5, 0x10000).is_none());
        assert!(probes.lookup(7, 0x40000).is_some());
        // Pid 3's exit is read before its exec, whose code the probes installed themselves
        // at the exec: the space is dead from the start, named from here, and what the
        // probes installed leaves them as its ranges are learned.
        let value = MappingValue { table: 1, flags: 0, start: 0x60000, end: 0x61000, bias: 0 };
        probes.insert_mapping(MappingKey::new(9, 0x60000), MappingKey::ASID_BITS + 52, value).unwrap();
        assert_eq!(spaces.learn_exit(3, 500, &mut probes), None);
        assert!(!spaces.learn_exec(3, 9, 400, &mut probes));
        assert!(!spaces.learn_fork(3, 7, 350, &mut probes));
        assert_eq!(spaces.first_space(3), None, "a fork older than the pid's exit: another process's");
        spaces.add_mapping(9, 0x60000, 0x1000, 0, None, &mut store, &mut probes);
        assert_eq!(spaces.asid_of(3), None);
        assert!(probes.lookup(9, 0x60000).is_none());
        assert!(spaces.find(9, 0x60000).is_some(), "kept for naming late frames");
        assert_eq!(spaces.spaces[&7].pids, 1, "the late fork counted nobody in the child's space");
        // Pid 4's mapping is read a drain before its exec, and its exit before both: the
        // range that went into the probes leaves them when the exec is read.
        spaces.add_mapping(11, 0x70000, 0x1000, 0, None, &mut store, &mut probes);
        assert!(probes.lookup(11, 0x70000).is_some());
        spaces.learn_exit(4, 520, &mut probes);
        assert!(!spaces.learn_exec(4, 11, 510, &mut probes));
        assert!(probes.lookup(11, 0x70000).is_none());
        // The pid taken again by a process forked after that exit is news.
        assert!(spaces.learn_fork(3, 7, 600, &mut probes));
        assert_eq!(spaces.asid_of(3), Some(7));
        assert_eq!(spaces.spaces[&7].pids, 2);
        // An exit older than the pid's current process leaves that process alone.
        assert_eq!(spaces.learn_exit(3, 550, &mut probes), None);
        assert_eq!(spaces.asid_of(3), Some(7));
        // The space is the last process's to leave.
        assert_eq!(spaces.learn_exit(2, 700, &mut probes), None);
        assert!(probes.lookup(7, 0x40000).is_some());
        assert_eq!(spaces.learn_exit(3, 800, &mut probes), Some(7));
        assert!(probes.trie.is_empty());
        assert_eq!(spaces.late_records(), 5, "the fork; pid 3's exec and fork; pid 4's exec; the old exit");
    }

    /// An exec read a drain late, after its process was learned in that very space from
    /// `/proc` (the kernel had given it): late, but the space is live, its ranges stay.
    #[test]
    fn a_late_exec_into_a_space_learned_from_proc_leaves_it_live() {
        let pid = std::process::id();
        let mut spaces = Spaces::new();
        let mut store = TableStore::new(None, 1, super::super::store::DEFAULT_MAX_BYTES);
        let mut probes = FakeProbes::default();
        probes.asids.insert(pid, 77);
        assert_eq!(spaces.learn_process(pid, &mut store, &mut probes), Some(77));
        let here = a_function as *const () as u64;
        assert!(probes.lookup(77, here).is_some());
        assert!(spaces.learn_exec(pid, 77, 1, &mut probes), "late, and live");
        assert_eq!(spaces.late_records(), 1);
        let m = spaces.find(77, here).unwrap().clone();
        spaces.forget_range(77, m.start, m.end, &mut probes);
        assert!(probes.lookup(77, here).is_some(), "a live space's ranges are not forgotten");
    }

    /// Memory made executable by `mprotect` is recorded unless known: a file's pages keep
    /// their file, a JIT's chunk stays whole when part of it changes protection again.
    #[test]
    fn memory_made_executable_joins_what_it_overlaps_and_leaves_files_alone() {
        let mut spaces = Spaces::new();
        let mut store = TableStore::new(None, 1, super::super::store::DEFAULT_MAX_BYTES);
        let mut probes = FakeProbes::default();
        spaces.learn_exec(1, 5, 10, &mut probes);
        assert_eq!(spaces.protected_range(5, 0x10000, 0x20000), Some((0x10000, 0x20000)), "nothing known");
        spaces.add_mapping(5, 0x10000, 0x10000, 0, None, &mut store, &mut probes);
        assert_eq!(spaces.protected_range(5, 0x11000, 0x12000), None, "inside the chunk");
        assert_eq!(spaces.protected_range(5, 0x1f000, 0x21000), Some((0x10000, 0x21000)), "grows it");
        assert_eq!(spaces.protected_range(5, 0x30000, 0x31000), Some((0x30000, 0x31000)));
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        spaces.add_mapping(5, 0x40000, 0x10000, 0, Some(&exe), &mut store, &mut probes);
        assert_eq!(spaces.protected_range(5, 0x3f000, 0x41000), None, "a file's pages");
    }
}
