//! Whole user stacks without frame pointers. The probes walk user stacks with rules this
//! module learns from each module's call-frame information (`.eh_frame`): when a probe
//! meets a frame it has no rule for, it sends the registers there and a copy of the stack
//! ([`StackMiss`], while the ring has room for it; otherwise the event keeps the partial
//! stack, marked truncated); [`Unwinder::finish`] walks the copy with rules computed from the
//! module file, and hands back the whole stack plus the rules, which the caller installs in
//! the probes' map so the next walk through the same code needs no copy.
//!
//! Rules are per address space (tgid and its exec generation) and per lookup address, so
//! they need no translation in the probe; the price is learning once per process.
pub mod tables;
pub mod walk;

use std::{
    collections::{HashMap, VecDeque},
    os::unix::fs::MetadataExt as _,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use gimli::UnwindContext;
use memtrace_common::{
    KERNEL_STACK_SEED, MISS_HASH_MARK, USER_STACK_SEED, UnwindKey, UnwindRule, stack_hash_step, unwind_kind,
};

use self::{
    tables::ModuleUnwind,
    walk::{End, Regs, StackCopy},
};
use crate::{
    elf,
    event::{FileMapping, RawUserFrame, StackMiss, StackRecord, UserWalk},
    procfs::{self, Mapping, Maps},
};

/// Processes whose maps are kept.
const MAX_PROCESS_MAPS: usize = 4096;
/// Module files whose unwind tables are kept.
const MAX_MODULES: usize = 512;
/// Rules remembered here (the probes' map is an LRU of its own size).
const MAX_RULES: usize = 1 << 20;
/// Modules with at most this many functions have every call site learned at once (a
/// program's own code, typically); larger ones function by function.
const WHOLE_MODULE_FUNCTIONS: usize = 512;
/// Functions remembered as learned whole (forgotten all at once beyond).
const MAX_LEARNED_FUNCTIONS: usize = 1 << 18;
/// How often a process's maps may be re-read when an address is not in them.
const MAPS_REFRESH: Duration = Duration::from_millis(10);

const STOP: UnwindRule = UnwindRule { cfa_offset: 0, rbp_offset: 0, kind: unwind_kind::STOP, _pad: 0 };

/// The hash the probes give a stack (see memtrace-ebpf `user_stack` / `kernel_stack`); a
/// stack that ends truncated after a miss is marked so it never equals a whole one.
pub fn stack_hash(pid: u32, joined_kernel: Option<&[u64]>, user: &[u64], truncated_by_miss: bool) -> u64 {
    let mut h = match joined_kernel {
        Some(kernel) => {
            let mut h = stack_hash_step(KERNEL_STACK_SEED, u64::from(pid));
            for &ip in kernel.iter().take_while(|&&ip| ip != 0) {
                h = stack_hash_step(h, ip);
            }
            stack_hash_step(h, u64::MAX)
        }
        None => stack_hash_step(USER_STACK_SEED, u64::from(pid)),
    };
    for &ip in user.iter().take_while(|&&ip| ip != 0) {
        h = stack_hash_step(h, ip);
    }
    if truncated_by_miss { stack_hash_step(h, MISS_HASH_MARK) } else { h }
}

/// A stack the probes could not finish, finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The hash the event that sent the copy refers to.
    pub event_hash: u64,
    /// The whole stack, under the hash the probes will give it once they know the rules.
    pub whole: StackRecord,
}

/// What the unwinder did, for the status line and the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnwindStats {
    /// Stack copies finished here.
    pub copies: u64,
    /// Rules computed and handed to the probes.
    pub rules: u64,
    /// Module files whose unwind tables were read.
    pub modules: u64,
    /// Copies that still ended truncated.
    pub truncated: u64,
}

struct ProcessMaps {
    maps: Maps,
    /// When /proc/PID/maps was last read (None: only mappings reported by the probes).
    read_at: Option<Instant>,
}

/// Where an address of a process lies.
enum Place {
    File {
        path: PathBuf,
        inode: u64,
        offset: u64,
    },
    /// Not in file-backed code: JIT-compiled code, data, nothing.
    NotFileCode,
    /// The process's maps are gone and were never read.
    Unknown,
}

pub struct Unwinder {
    maps: HashMap<u32, ProcessMaps>,
    maps_order: VecDeque<u32>,
    modules: HashMap<(PathBuf, u64), Option<Arc<ModuleUnwind>>>,
    build_ids: HashMap<(PathBuf, u64), Option<[u8; 20]>>,
    /// Files frames were named into since the last `take_new_files`.
    new_files: Vec<PathBuf>,
    rules: HashMap<UnwindKey, UnwindRule>,
    /// (tgid, generation, module, function start) whose call sites all have rules: one
    /// copy teaches every call site of the functions it passes through, so the next stack
    /// through them (another call site of the same caller) needs none.
    learned_functions: std::collections::HashSet<(u32, u32, usize, u64)>,
    ctx: Box<UnwindContext<usize>>,
    learned: Vec<(UnwindKey, UnwindRule)>,
    stats: UnwindStats,
}

impl Default for Unwinder {
    fn default() -> Self {
        Self::new()
    }
}

impl Unwinder {
    pub fn new() -> Self {
        Self {
            maps: HashMap::new(),
            maps_order: VecDeque::new(),
            modules: HashMap::new(),
            build_ids: HashMap::new(),
            new_files: Vec::new(),
            rules: HashMap::new(),
            learned_functions: std::collections::HashSet::new(),
            ctx: Box::new(UnwindContext::new()),
            learned: Vec::new(),
            stats: UnwindStats::default(),
        }
    }

    pub fn stats(&self) -> UnwindStats {
        self.stats
    }

    /// Reads the maps of `pid` now, while it lives (at exec: a short-lived process may be
    /// gone by the time its first stack copy is read).
    pub fn learn_process(&mut self, pid: u32) -> bool {
        let Ok(maps) = Maps::read(pid) else { return false };
        // Read the unwind tables of its code now, not when its first stacks wait on them.
        for m in maps.file_mappings().filter(|m| m.executable) {
            self.module(pid, m.path.clone(), m.inode);
        }
        self.keep_maps(pid, maps, Some(Instant::now()));
        true
    }

    /// A forked child starts with its parent's address space.
    pub fn learn_fork(&mut self, child: u32, parent: u32) {
        if let Some(maps) = self.maps.get(&parent).map(|p| p.maps.clone()) {
            // Not read for the child itself: an address missing from them is re-read.
            self.keep_maps(child, maps, None);
        }
    }

    /// A file the probes saw the process map executable (how ld.so and dlopen load code).
    pub fn learn_mapping(&mut self, m: &FileMapping) {
        let path = PathBuf::from(&m.path);
        if !path.is_absolute() {
            return;
        }
        let inode = std::fs::metadata(procfs::path_in_process(m.pid, &path)).map_or(0, |md| md.ino());
        self.module(m.pid, path.clone(), inode.max(1));
        let mapping = Mapping {
            start: m.start,
            end: m.start.saturating_add(m.len.max(1)),
            executable: true,
            offset: m.file_offset,
            inode: inode.max(1),
            path,
            deleted: false,
        };
        match self.maps.get_mut(&m.pid) {
            Some(p) => {
                let maps = &mut p.maps.mappings;
                maps.retain(|x| x.end <= mapping.start || x.start >= mapping.end);
                let at = maps.partition_point(|x| x.start < mapping.start);
                maps.insert(at, mapping);
            }
            None => self.keep_maps(m.pid, Maps { mappings: vec![mapping] }, None),
        }
    }

    fn keep_maps(&mut self, pid: u32, maps: Maps, read_at: Option<Instant>) {
        if self.maps.insert(pid, ProcessMaps { maps, read_at }).is_none() {
            self.maps_order.push_back(pid);
            while self.maps_order.len() > MAX_PROCESS_MAPS {
                if let Some(old) = self.maps_order.pop_front() {
                    self.maps.remove(&old);
                }
            }
        }
    }

    /// Names the user frames of a call-frame walk by build id and file offset, where the
    /// maps of the process say which file an address lies in.
    pub fn name_frames(&mut self, stack: &mut StackRecord) {
        for i in 0..stack.user.len() {
            let RawUserFrame::Ip(ip) = stack.user[i] else { continue };
            if let Place::File { path, inode, offset } = self.place(stack.pid, ip)
                && let Some(build_id) = self.build_id(stack.pid, path, inode)
            {
                stack.user[i] = RawUserFrame::BuildId { build_id, offset };
            }
        }
    }

    fn build_id(&mut self, pid: u32, path: PathBuf, inode: u64) -> Option<[u8; 20]> {
        let key = (path, inode);
        if let Some(id) = self.build_ids.get(&key) {
            return *id;
        }
        if self.build_ids.len() >= MAX_MODULES {
            self.build_ids.clear();
        }
        let file = procfs::path_in_process(pid, &key.0);
        let id = elf::build_id(&file).and_then(|b| <[u8; 20]>::try_from(b).ok());
        if id.is_some() {
            self.new_files.push(file);
        }
        self.build_ids.insert(key, id);
        id
    }

    /// Files frames were named into since the last call (their build ids must be known to
    /// whoever symbolizes them).
    pub fn take_new_files(&mut self) -> Vec<PathBuf> {
        std::mem::take(&mut self.new_files)
    }

    /// Rules computed since the last call, for the probes' map.
    pub fn take_learned(&mut self) -> Vec<(UnwindKey, UnwindRule)> {
        std::mem::take(&mut self.learned)
    }

    /// Finishes the walk of a stack record that carries a copy; None for any other record.
    pub fn finish(&mut self, record: &StackRecord) -> Option<Finished> {
        let miss = record.miss.as_ref()?;
        self.stats.copies += 1;
        let mut ips: Vec<u64> = record
            .user
            .iter()
            .map(|f| match *f {
                RawUserFrame::Ip(ip) => ip,
                RawUserFrame::BuildId { offset, .. } => offset,
            })
            .collect();
        let regs = Regs { ip: miss.ip, sp: miss.sp, bp: miss.bp, exact: miss.exact };
        if ips.last() != Some(&miss.ip) {
            ips.push(miss.ip);
        }
        let memory = StackCopy { base: miss.sp, bytes: &miss.copy };
        let end = walk::walk(regs, &memory, &mut ips, miss.ret_addr, |addr| self.rule(record.pid, miss, addr));
        let truncated = end == End::Truncated;
        if truncated {
            self.stats.truncated += 1;
        }
        let joined = record.joined_kernel.then_some(&record.kernel[..]);
        let whole = StackRecord {
            hash: stack_hash(record.pid, joined, &ips, truncated),
            pid: record.pid,
            kernel: record.kernel.clone(),
            user: ips.into_iter().map(RawUserFrame::Ip).collect(),
            walk: UserWalk::CallFrameInfo,
            truncated,
            joined_kernel: record.joined_kernel,
            miss: None,
        };
        Some(Finished { event_hash: record.hash, whole })
    }

    /// The rule at lookup address `addr` of the address space the miss came from; None
    /// when nothing can be known of it (the process is gone), so nothing is learned.
    fn rule(&mut self, pid: u32, miss: &StackMiss, addr: u64) -> Option<UnwindRule> {
        let key = UnwindKey { tgid: pid, generation: miss.generation, addr };
        if let Some(rule) = self.rules.get(&key) {
            return Some(*rule);
        }
        let rule = match self.place(pid, addr) {
            Place::File { path, inode, offset } => {
                let Some(module) = self.module(pid, path, inode) else { return Some(self.remember(key, STOP)) };
                let Some(vaddr) = module.vaddr_of_file_offset(offset) else { return Some(self.remember(key, STOP)) };
                let rule = module.rule_at(vaddr, &mut self.ctx);
                self.learn_call_sites(key, &module, vaddr);
                rule
            }
            Place::NotFileCode => STOP,
            Place::Unknown => return None,
        };
        Some(self.remember(key, rule))
    }

    fn remember(&mut self, key: UnwindKey, rule: UnwindRule) -> UnwindRule {
        if self.rules.len() >= MAX_RULES {
            self.rules.clear();
            self.learned_functions.clear();
        }
        if self.rules.insert(key, rule).is_none() {
            self.learned.push((key, rule));
            self.stats.rules += 1;
        }
        rule
    }

    /// Learns the rules at every call site of the function containing `vaddr` (of the
    /// whole module when it is small), in the address space of `key`.
    fn learn_call_sites(&mut self, key: UnwindKey, module: &Arc<ModuleUnwind>, vaddr: u64) {
        let bias = key.addr.wrapping_sub(vaddr);
        let id = Arc::as_ptr(module) as usize;
        let functions: Vec<(u64, u64)> = if module.fde_count() <= WHOLE_MODULE_FUNCTIONS {
            if !self.learned_functions.insert((key.tgid, key.generation, id, u64::MAX)) {
                return;
            }
            module.functions().collect()
        } else {
            match module.function_at(vaddr) {
                Some(f) if self.learned_functions.insert((key.tgid, key.generation, id, f.0)) => vec![f],
                _ => return,
            }
        };
        if self.learned_functions.len() >= MAX_LEARNED_FUNCTIONS {
            self.learned_functions.clear();
        }
        for (start, end) in functions {
            for ret in module.return_addresses(start, end) {
                let site = UnwindKey { addr: (ret - 1).wrapping_add(bias), ..key };
                if !self.rules.contains_key(&site) {
                    let rule = module.rule_at(ret - 1, &mut self.ctx);
                    self.remember(site, rule);
                }
            }
        }
    }

    /// The unwind tables of a file (by the path process `pid` sees), read once.
    fn module(&mut self, pid: u32, path: PathBuf, inode: u64) -> Option<Arc<ModuleUnwind>> {
        let key = (path, inode);
        if let Some(module) = self.modules.get(&key) {
            return module.clone();
        }
        if self.modules.len() >= MAX_MODULES {
            self.modules.clear();
        }
        let module = ModuleUnwind::open(&procfs::path_in_process(pid, &key.0)).ok().map(Arc::new);
        self.stats.modules += 1;
        self.modules.insert(key, module.clone());
        module
    }

    fn place(&mut self, pid: u32, addr: u64) -> Place {
        // Some(place) when the maps say; None when the address is in no mapping.
        let lookup = |maps: &Maps| match maps.find(addr) {
            Some(m) if m.executable && m.is_file() => {
                Some(Place::File { path: m.path.clone(), inode: m.inode, offset: m.file_offset(addr) })
            }
            Some(_) => Some(Place::NotFileCode),
            None => None,
        };
        if let Some(place) = self.maps.get(&pid).and_then(|p| lookup(&p.maps)) {
            return place;
        }
        // In no mapping read so far: maybe mapped since (dlopen, exec). Re-read, at a
        // bounded rate; only a fresh read may conclude that the address is not file code
        // (the conclusion becomes a rule).
        let fresh = self.maps.get(&pid).and_then(|p| p.read_at).is_some_and(|t| t.elapsed() < MAPS_REFRESH);
        if fresh || !self.learn_process(pid) {
            return Place::Unknown;
        }
        self.maps.get(&pid).and_then(|p| lookup(&p.maps)).unwrap_or(Place::NotFileCode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_the_probes_construction() {
        let user = [0x10, 0x20];
        let mut h = stack_hash_step(USER_STACK_SEED, 7);
        h = stack_hash_step(stack_hash_step(h, 0x10), 0x20);
        assert_eq!(stack_hash(7, None, &user, false), h);
        assert_eq!(stack_hash(7, None, &user, true), stack_hash_step(h, MISS_HASH_MARK));
        let mut k = stack_hash_step(KERNEL_STACK_SEED, 7);
        k = stack_hash_step(k, 0xffff_0001);
        k = stack_hash_step(k, u64::MAX);
        k = stack_hash_step(stack_hash_step(k, 0x10), 0x20);
        assert_eq!(stack_hash(7, Some(&[0xffff_0001, 0]), &user, false), k);
    }

    /// Unwinds this very thread from a copy of its own stack, as the probes' miss path
    /// would: the test harness's frames up to the thread start must be found.
    #[test]
    #[inline(never)]
    fn finishes_a_real_stack_from_a_copy() {
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers; no memory is touched.
        unsafe {
            std::arch::asm!("lea {ip}, [rip]", "mov {sp}, rsp", "mov {bp}, rbp", ip = out(reg) ip, sp = out(reg) sp, bp = out(reg) bp);
        }
        let stack_end = Maps::read_self().unwrap().find(sp).unwrap().end;
        let len = (stack_end - sp).min(64 * 1024) as usize;
        // SAFETY: [sp, sp + len) lies in this thread's mapped stack, above our own frame.
        let copy = unsafe { std::slice::from_raw_parts(sp as *const u8, len) }.to_vec();
        let pid = std::process::id();
        let record = StackRecord {
            hash: 1,
            pid,
            kernel: vec![],
            user: vec![RawUserFrame::Ip(ip)],
            walk: UserWalk::CallFrameInfo,
            truncated: false,
            joined_kernel: false,
            miss: Some(StackMiss { ip, sp, bp, ret_addr: 0, generation: 0, exact: true, copy }),
        };
        let mut unwinder = Unwinder::new();
        let finished = unwinder.finish(&record).unwrap();
        assert!(!finished.whole.truncated, "{:?}", finished.whole);
        assert!(finished.whole.user.len() > 3);
        assert_eq!(finished.whole.hash, stack_hash(pid, None, &ips(&finished.whole), false));
        assert!(!unwinder.take_learned().is_empty());
        // The second time, every rule is known.
        let again = unwinder.finish(&record).unwrap();
        assert_eq!(again.whole, finished.whole);
        assert!(unwinder.take_learned().is_empty());
    }

    fn ips(s: &StackRecord) -> Vec<u64> {
        s.user.iter().map(|f| if let RawUserFrame::Ip(ip) = f { *ip } else { 0 }).collect()
    }
}
