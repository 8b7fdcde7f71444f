//! Naming user code position-independently while the processes still live: the probes
//! report user frames as (build id, file offset) when the kernel could resolve them, else
//! as bare addresses. This table turns both into (module, file offset), learning which
//! file carries which build id from the processes' memory maps, so frames can be
//! symbolized later, after the processes are gone, from the files themselves.
use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{
    FastMap,
    at_start::{Snapshot, StartView},
    elf,
    event::{RawUserFrame, UserWalk},
    procfs::{self, Maps},
    python::{self, PythonContext, Spliced},
    recording::{FileFrame, Module},
};

/// File offsets at or past this are not real frames.
const MAX_FILE_OFFSET: u64 = 1 << 40;

/// Processes whose maps are kept.
const MAX_PROCESS_MAPS: usize = 4096;

/// How often a process's maps may be re-read when an address is not in them.
const MAPS_REFRESH: Duration = Duration::from_millis(50);

const SYSTEM_DIRS: &[&str] =
    &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/usr/lib"];

struct ProcessMaps {
    maps: Maps,
    read_at: Instant,
}

#[derive(Default)]
pub struct ModuleTable {
    modules: Vec<Module>,
    by_build_id: FastMap<Vec<u8>, u32>,
    by_path: FastMap<PathBuf, u32>,
    /// Build id → a file that has it.
    catalog: FastMap<Vec<u8>, PathBuf>,
    /// File → its build id (None: it has none or cannot be read).
    file_build_ids: FastMap<PathBuf, Option<Vec<u8>>>,
    maps: FastMap<u32, ProcessMaps>,
    maps_order: std::collections::VecDeque<u32>,
    scanned_system_dirs: bool,
    /// Modules created since the last `take_new`.
    pending: Vec<u32>,
    /// The module of each Python function (qualified name, file) met: a Python-heavy
    /// program names the same few hundred functions in tens of thousands of stacks.
    python_functions: FastMap<std::sync::Arc<python::code::PyFunction>, u32>,
    /// The processes running when the session began, as they were then (`record -a`).
    at_start: StartView,
}

impl ModuleTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn modules(&self) -> &[Module] {
        &self.modules
    }

    /// Modules created since the last call, for the writer to define.
    pub fn take_new(&mut self) -> Vec<Module> {
        std::mem::take(&mut self.pending).into_iter().map(|id| self.modules[id as usize].clone()).collect()
    }

    fn file_build_id(&mut self, path: &Path) -> Option<Vec<u8>> {
        if let Some(id) = self.file_build_ids.get(path) {
            return id.clone();
        }
        let id = elf::build_id(path);
        if let Some(id) = &id {
            self.catalog.entry(id.clone()).or_insert_with(|| path.to_path_buf());
            // A module first met without a known file gets its path now (and is defined
            // again for the writer).
            if let Some(&m) = self.by_build_id.get(id)
                && self.modules[m as usize].path.is_empty()
            {
                self.modules[m as usize].path = path.to_string_lossy().into_owned();
                self.pending.push(m);
            }
        }
        self.file_build_ids.insert(path.to_path_buf(), id.clone());
        id
    }

    /// The processes running when the session began, as they were then: the first read of
    /// one of them takes its maps from there until it changes (a shell that exec'd its last
    /// command before its first stack was read has that program's maps in /proc).
    pub fn set_at_start(&mut self, snapshot: std::sync::Arc<Snapshot>) {
        self.at_start = StartView::new(snapshot);
    }

    /// Reads the maps of `pid` (if it still lives; from the session's snapshot the first
    /// time, while that holds) and learns the build ids of its files.
    pub fn learn_process(&mut self, pid: u32) -> bool {
        let (maps, from_start) = match self.at_start.take_maps(pid) {
            Some((maps, _)) => (maps, true),
            None => match Maps::read(pid) {
                Ok(maps) => (maps, false),
                Err(_) => return false,
            },
        };
        let paths: Vec<PathBuf> =
            maps.file_mappings().filter(|m| m.executable).map(|m| procfs::path_in_process(pid, &m.path)).collect();
        for path in paths {
            self.file_build_id(&path);
        }
        self.keep_maps(pid, maps);
        if from_start && let Some(m) = self.maps.get_mut(&pid) {
            // As old as they are: an address in none (a library loaded since) has `/proc`
            // read at once.
            m.read_at = m.read_at.checked_sub(MAPS_REFRESH).unwrap_or(m.read_at);
        }
        true
    }

    /// The executable mappings of `pid` as the probes saw them: kept where its `/proc` maps
    /// cannot be read any more (it exited before they were), so frames in files without a
    /// build id are still named by file.
    pub fn learn_maps(&mut self, pid: u32, maps: Maps) {
        if Maps::read(pid).is_err() {
            self.maps.remove(&pid);
            self.maps_order.retain(|&p| p != pid);
            self.keep_maps(pid, maps);
        }
    }

    /// A forked child starts with its parent's maps (it may exit, or exec another program,
    /// before its own can be read). A parent not met yet (running before tracing began,
    /// under `-a`) is read now, while it still runs what the child runs. Returns whether
    /// the child has maps.
    pub fn learn_fork(&mut self, child: u32, parent: u32) -> bool {
        self.at_start.changed(child);
        // (Maps of the parent read a while ago, at its exec, are kept: read now, they may be
        // those of a program it exec'd since. The copy keeps their age, so a frame they do
        // not cover has the child's own read.)
        if parent != 0 && !self.maps.contains_key(&parent) {
            self.learn_process(parent);
        }
        let Some((maps, read_at)) = self.maps.get(&parent).map(|p| (p.maps.clone(), p.read_at)) else { return false };
        // In place of what an earlier process of this pid left.
        if self.maps.remove(&child).is_some() {
            self.maps_order.retain(|&p| p != child);
        }
        self.keep_maps(child, maps);
        if let Some(m) = self.maps.get_mut(&child) {
            m.read_at = read_at;
        }
        true
    }

    fn keep_maps(&mut self, pid: u32, maps: Maps) {
        if self.maps.insert(pid, ProcessMaps { maps, read_at: Instant::now() }).is_none() {
            self.maps_order.push_back(pid);
            // The maps of exited processes are kept (the last word on their layout) up to a
            // bound.
            while self.maps_order.len() > MAX_PROCESS_MAPS {
                if let Some(old) = self.maps_order.pop_front() {
                    self.maps.remove(&old);
                }
            }
        }
    }

    /// Forgets the maps of processes that are gone, so a long-running tracer (`serve`)
    /// keeps only those of the processes it still follows.
    pub fn forget_processes(&mut self, pids: &std::collections::HashSet<u32>) {
        if pids.is_empty() {
            return;
        }
        self.maps.retain(|pid, _| !pids.contains(pid));
        for &pid in pids {
            self.at_start.changed(pid);
        }
        self.maps_order.retain(|pid| !pids.contains(pid));
    }

    /// Learns the build id of the program a process just exec'd (from /proc while it
    /// lives, else from the exec'd file name).
    pub fn learn_exec(&mut self, pid: u32, filename: &Path) {
        self.at_start.changed(pid);
        // The new image replaces the old maps; read them now, the process may be short-lived.
        if !self.learn_process(pid) {
            self.maps.remove(&pid);
        }
        let exe = procfs::exe(pid).ok().map(|p| procfs::path_in_process(pid, &p));
        match exe {
            Some(exe) => {
                self.file_build_id(&exe);
            }
            None if filename.is_absolute() => {
                self.file_build_id(filename);
            }
            None => {}
        }
    }

    /// Finds the files of modules known only by build id (their processes were gone),
    /// among the system libraries. Slow (reads every library's notes once): call it when
    /// tracing is over. Modules found are defined again by `take_new`.
    pub fn find_missing_files(&mut self) {
        if self.modules.iter().any(|m| m.path.is_empty() && !m.build_id.is_empty()) {
            self.scan_system_dirs();
        }
    }

    fn scan_system_dirs(&mut self) {
        if self.scanned_system_dirs {
            return;
        }
        self.scanned_system_dirs = true;
        for dir in SYSTEM_DIRS {
            let Ok(entries) = fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name.contains(".so") && path.is_file() {
                    self.file_build_id(&path);
                }
            }
        }
    }

    fn module_id(&mut self, build_id: Option<Vec<u8>>, path: Option<PathBuf>) -> u32 {
        if let Some(id) = build_id.as_ref().and_then(|b| self.by_build_id.get(b)) {
            return *id;
        }
        if build_id.is_none()
            && let Some(id) = path.as_ref().and_then(|p| self.by_path.get(p))
        {
            return *id;
        }
        let id = self.modules.len() as u32;
        let path_str = path.as_ref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        self.modules.push(Module { id, build_id: build_id.clone().unwrap_or_default(), path: path_str });
        match build_id {
            Some(b) => {
                self.by_build_id.insert(b, id);
            }
            None => {
                if let Some(p) = path {
                    self.by_path.insert(p, id);
                }
            }
        }
        self.pending.push(id);
        id
    }

    fn module_for_build_id(&mut self, pid: u32, build_id: &[u8]) -> u32 {
        if let Some(&id) = self.by_build_id.get(build_id) {
            return id;
        }
        if !self.catalog.contains_key(build_id) {
            self.learn_process(pid);
        }
        // Still unknown: its file is looked for among the system libraries later
        // (`find_missing_files`), not here, where tracing waits.
        let path = self.catalog.get(build_id).cloned();
        self.module_id(Some(build_id.to_vec()), path)
    }

    fn mapping_for(&mut self, pid: u32, ip: u64) -> Place {
        let lookup = |table: &Self| -> Option<Place> {
            let maps = &table.maps.get(&pid)?.maps;
            Some(match maps.find(ip) {
                Some(m) if m.executable && m.is_file() => {
                    Place::File(procfs::path_in_process(pid, &m.path), m.file_offset(ip))
                }
                Some(m) if m.executable => Place::AnonymousCode,
                _ => Place::NotCode,
            })
        };
        let stale = self.maps.get(&pid).is_none_or(|m| m.read_at.elapsed() > MAPS_REFRESH);
        match lookup(self) {
            Some(place @ (Place::File(..) | Place::AnonymousCode)) => place,
            found => {
                if stale && self.learn_process(pid) {
                    lookup(self).unwrap_or(Place::Unknown)
                } else {
                    found.unwrap_or(Place::Unknown)
                }
            }
        }
    }

    /// Learns the build id of a file frames point into (from the unwinder, which read the
    /// maps of a process that may be gone now).
    pub fn learn_file(&mut self, path: &Path) {
        self.file_build_id(path);
    }

    /// The user frames of stack record `s` as modules and file offsets
    /// ([`Self::resolve_stack`]), and whether the walk was cut short: marked so by the
    /// probes, or found so here. A frame-pointer walk of a user allocation's stack that
    /// the kernel ended at its first frame is cut short too: that frame is the allocator's
    /// caller, which was called from somewhere, so the register the walk took for its frame
    /// pointer was none (code built without frame pointers; Debian's libraries). Where that
    /// register held a small number or a freed page, the kernel's walk just stopped, and the
    /// stack looked whole.
    pub fn resolve_record(&mut self, s: &crate::event::StackRecord) -> (Vec<FileFrame>, bool) {
        let (user, cut) = self.resolve_stack(s.pid, &s.user, s.python_context.as_deref(), s.walk);
        let alone = s.walk == UserWalk::FramePointers && !s.joined_kernel && s.user.len() == 1;
        (user, s.truncated || cut || alone)
    }

    /// A user stack of process `pid` as modules and file offsets. A frame-pointer walk is
    /// cut where it went astray: at an address that is not code (the walk followed a
    /// register that was not a frame pointer), and at a frame repeated to the depth limit
    /// (a pointer loop); a call-frame walk is taken as it is. Returns the frames and whether
    /// the stack was cut.
    pub fn resolve_stack(
        &mut self,
        pid: u32,
        raw: &[RawUserFrame],
        context: Option<&PythonContext>,
        walk: UserWalk,
    ) -> (Vec<FileFrame>, bool) {
        let (native, truncated) = self.resolve_native(pid, raw, walk);
        match context {
            Some(context) if !context.names.is_empty() => (self.with_python(&native, context), truncated),
            _ => (native, truncated),
        }
    }

    /// Puts the Python frames in place of the evaluation loop's native frames
    /// ([`python::splice`]), each as a frame of its (function, file) module at its line.
    fn with_python(&mut self, native: &[FileFrame], context: &PythonContext) -> Vec<FileFrame> {
        let build_id = self.file_build_id(&context.interpreter);
        let interpreter = self.module_id(build_id, Some(context.interpreter.clone()));
        let is_eval = |f: &FileFrame| match f {
            FileFrame::Module { module, offset } => {
                *module == interpreter && context.eval.iter().any(|r| r.contains(&offset.saturating_sub(1)))
            }
            FileFrame::Address(_) => false,
        };
        python::splice(native, is_eval, &context.names)
            .into_iter()
            .map(|f| match f {
                Spliced::Native(f) => f,
                Spliced::Python(i) => {
                    let named = &context.names[i];
                    let function = &named.function;
                    let module = match self.python_functions.get(function) {
                        Some(&module) => module,
                        None => {
                            let build_id = python::module_build_id(&function.qualname, &function.filename);
                            let module = self.module_id(Some(build_id), Some(PathBuf::from(&*function.filename)));
                            self.python_functions.insert(std::sync::Arc::clone(function), module);
                            module
                        }
                    };
                    FileFrame::Module { module, offset: u64::from(named.line) }
                }
            })
            .collect()
    }

    fn resolve_native(&mut self, pid: u32, raw: &[RawUserFrame], walk: UserWalk) -> (Vec<FileFrame>, bool) {
        let checked = walk == UserWalk::FramePointers;
        let mut frames = Vec::with_capacity(raw.len());
        let mut truncated = false;
        // The module of the frame before: most frames are in their caller's file, and
        // hashing the build id of each was a cost of its own in deep stacks.
        let mut last: Option<([u8; 20], u32)> = None;
        for &frame in raw {
            let resolved = match frame {
                // No object file is a terabyte long: the walk went astray.
                RawUserFrame::BuildId { offset, .. } if checked && offset >= MAX_FILE_OFFSET => {
                    truncated = true;
                    break;
                }
                RawUserFrame::BuildId { build_id, offset } => {
                    let module = match last {
                        Some((id, module)) if id == build_id => module,
                        _ => self.module_for_build_id(pid, &build_id),
                    };
                    last = Some((build_id, module));
                    FileFrame::Module { module, offset }
                }
                RawUserFrame::Ip(ip) => match self.mapping_for(pid, ip) {
                    Place::File(path, offset) => {
                        let build_id = self.file_build_id(&path);
                        FileFrame::Module { module: self.module_id(build_id, Some(path)), offset }
                    }
                    Place::AnonymousCode | Place::Unknown => FileFrame::Address(ip),
                    Place::NotCode if !checked => FileFrame::Address(ip),
                    Place::NotCode => {
                        truncated = true;
                        break;
                    }
                },
            };
            frames.push(resolved);
        }
        if checked && raw.len() >= memtrace_common::MAX_STACK_DEPTH {
            truncated = true;
            let last = frames.last().copied();
            while frames.len() >= 2
                && frames[frames.len() - 2] == frames[frames.len() - 1]
                && Some(frames[frames.len() - 1]) == last
            {
                frames.pop();
            }
        }
        (frames, truncated)
    }

    /// A single user frame of process `pid` (see [`Self::resolve_stack`]).
    pub fn resolve(&mut self, pid: u32, frame: RawUserFrame) -> FileFrame {
        let (frames, _) = self.resolve_native(pid, &[frame], UserWalk::FramePointers);
        frames.first().copied().unwrap_or(match frame {
            RawUserFrame::Ip(ip) => FileFrame::Address(ip),
            RawUserFrame::BuildId { offset, .. } => FileFrame::Address(offset),
        })
    }
}

/// Where an address of a process lies.
enum Place {
    File(PathBuf, u64),
    /// Executable memory without a file (JIT-compiled code).
    AnonymousCode,
    /// Mapped data, or nothing: not a return address.
    NotCode,
    /// The process's maps are not known.
    Unknown,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(marker as *const () as u64)
    }

    #[test]
    fn names_our_own_code_by_build_id_and_by_address_alike() {
        let pid = std::process::id();
        let ip = marker();
        let mut table = ModuleTable::new();
        let by_ip = table.resolve(pid, RawUserFrame::Ip(ip));
        let FileFrame::Module { module, offset } = by_ip else { panic!("{by_ip:?}") };
        let m = table.modules()[module as usize].clone();
        assert_eq!(m.build_id.len(), 20, "test binaries carry a GNU build id");
        let mut id = [0u8; 20];
        id.copy_from_slice(&m.build_id);
        let by_build_id = table.resolve(pid, RawUserFrame::BuildId { build_id: id, offset });
        assert_eq!(by_build_id, by_ip);
        assert_eq!(table.take_new().len(), 1);
        assert!(table.take_new().is_empty());
    }

    /// A child forked by a process not met yet (running before `-a` began) has its
    /// parent's maps, read at the fork, whatever its own `/proc` shows later.
    #[test]
    fn a_forked_child_has_its_parents_maps_even_of_a_parent_not_met_yet() {
        let pid = std::process::id();
        let mut table = ModuleTable::new();
        assert!(table.learn_fork(u32::MAX - 1, pid));
        let code = Maps::read_self().unwrap().mappings.into_iter().find(|m| m.executable && m.is_file()).unwrap();
        assert!(matches!(table.mapping_for(u32::MAX - 1, code.start), Place::File(..)));
        assert!(!table.learn_fork(u32::MAX - 2, u32::MAX - 3), "a parent gone: nothing to copy");
    }

    #[test]
    fn maps_of_processes_gone_are_forgotten() {
        let pid = std::process::id();
        let mut table = ModuleTable::new();
        assert!(table.learn_process(pid));
        table.learn_fork(pid + 1, pid);
        assert_eq!(table.maps.len(), 2);
        table.forget_processes(&[pid + 1].into_iter().collect());
        assert_eq!((table.maps.len(), table.maps_order.len()), (1, 1));
        assert!(table.maps.contains_key(&pid));
    }

    #[test]
    fn a_walk_into_data_is_cut_there() {
        let pid = std::process::id();
        let mut table = ModuleTable::new();
        let data = Box::new(0u64);
        let frames =
            [RawUserFrame::Ip(marker()), RawUserFrame::Ip(&*data as *const u64 as u64), RawUserFrame::Ip(marker())];
        let (resolved, truncated) = table.resolve_stack(pid, &frames, None, UserWalk::FramePointers);
        assert!(truncated);
        assert_eq!(resolved.len(), 1);
        // A process we know nothing of: addresses stay addresses.
        assert_eq!(
            table.resolve_stack(0, &[RawUserFrame::Ip(16)], None, UserWalk::FramePointers),
            (vec![FileFrame::Address(16)], false)
        );
    }

    #[test]
    fn a_frame_pointer_walk_of_a_user_allocation_ended_at_its_first_frame_is_cut_short() {
        let pid = std::process::id();
        let mut table = ModuleTable::new();
        let record = |user: Vec<RawUserFrame>, walk: UserWalk, joined_kernel: bool| crate::event::StackRecord {
            hash: 1,
            pid,
            kernel: Vec::new(),
            user,
            walk,
            truncated: false,
            no_room: false,
            joined_kernel,
            miss: None,
            asid: 0,
            python_context: None,
            py_key: 0,
        };
        let one = vec![RawUserFrame::Ip(marker())];
        let (frames, cut) = table.resolve_record(&record(one.clone(), UserWalk::FramePointers, false));
        assert!(cut);
        assert_eq!(frames.len(), 1);
        // Two frames, a call-frame walk, or the user part of a kernel allocation's stack
        // (a page fault in a program's entry code has no caller): as the walk left them.
        let two = vec![RawUserFrame::Ip(marker()), RawUserFrame::Ip(marker() + 1)];
        assert!(!table.resolve_record(&record(two, UserWalk::FramePointers, false)).1);
        assert!(!table.resolve_record(&record(one.clone(), UserWalk::CallFrameInfo, false)).1);
        assert!(!table.resolve_record(&record(one, UserWalk::FramePointers, true)).1);
    }

    #[test]
    fn a_frame_pointer_loop_to_the_depth_limit_is_collapsed() {
        let pid = std::process::id();
        let mut table = ModuleTable::new();
        let mut frames = vec![RawUserFrame::Ip(marker())];
        frames.extend(std::iter::repeat_n(RawUserFrame::Ip(marker() + 1), memtrace_common::MAX_STACK_DEPTH - 1));
        let (resolved, truncated) = table.resolve_stack(pid, &frames, None, UserWalk::FramePointers);
        assert!(truncated);
        assert_eq!(resolved.len(), 2);
    }

    #[test]
    fn a_build_id_of_a_gone_process_is_found_among_system_libraries() {
        let libc = Maps::read_self()
            .unwrap()
            .file_mappings()
            .find(|m| m.path.to_string_lossy().contains("libc.so"))
            .unwrap()
            .path
            .clone();
        let id = elf::build_id(&libc).unwrap();
        let mut table = ModuleTable::new();
        let frame = RawUserFrame::BuildId { build_id: id.clone().try_into().unwrap(), offset: 0x100 };
        // pid 0 has no maps: the file is found among the system libraries, afterwards.
        let FileFrame::Module { module, .. } = table.resolve(0, frame) else { panic!() };
        assert!(table.modules()[module as usize].path.is_empty());
        table.find_missing_files();
        let found = &table.modules()[module as usize];
        assert_eq!(fs::canonicalize(&found.path).unwrap(), fs::canonicalize(&libc).unwrap());
    }

    #[test]
    fn frames_of_a_gone_process_in_a_file_without_build_id_are_named_by_the_probes_maps() {
        // A file with no build id, "mapped" by a process that no longer exists (pid 0 has
        // no /proc maps).
        let tmp = tempfile::Builder::new().prefix("memtrace-modules-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let file = dir.join("static_prog");
        fs::write(&file, b"not an ELF file").unwrap();
        let mapping = procfs::Mapping {
            start: 0x401000,
            end: 0x402000,
            executable: true,
            offset: 0x1000,
            inode: 1,
            path: file.clone(),
            deleted: false,
        };
        let mut table = ModuleTable::new();
        let frame = RawUserFrame::Ip(0x401189);
        assert_eq!(table.resolve(0, frame), FileFrame::Address(0x401189), "nothing known yet");
        table.learn_maps(0, Maps { mappings: vec![mapping] });
        let FileFrame::Module { module, offset } = table.resolve(0, frame) else { panic!() };
        assert_eq!(offset, 0x1189);
        assert_eq!(table.modules()[module as usize].path, file.to_string_lossy());
        // Outside the mapping: still an address.
        assert_eq!(table.resolve(0, RawUserFrame::Ip(0x500000)), FileFrame::Address(0x500000));
        // A live process's own maps are not replaced by what the probes saw.
        let me = std::process::id();
        assert!(table.learn_process(me));
        let before = table.maps[&me].maps.clone();
        table.learn_maps(me, Maps::default());
        assert_eq!(table.maps[&me].maps, before);
        fs::remove_dir_all(&dir).unwrap();
    }
}
