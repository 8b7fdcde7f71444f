//! Naming what the probes report while the processes live, one way for every consumer:
//! `record` writes what this finds into the recording, `top` shows it at once, so both
//! name the same frames the same. Stack hashes become stack ids; user frames become
//! (module, file offset) through the [`ModuleTable`], whose maps of a process are read
//! when its first stack arrives and read again after it execs; a process met for the
//! first time is named from /proc while it still runs.
use std::path::Path;

use memtrace_common::{TaskEvent, flags};

use crate::{
    event::{Event, StackRecord, Task},
    modules::ModuleTable,
    procfs,
    recording::FileStack,
};

#[derive(Default)]
pub struct Namer {
    pub modules: ModuleTable,
    /// Probe stack hash → stack id.
    stack_ids: crate::stack_ids::StackIds,
    /// Stacks already defined, a bit per stack id (ids are given in order: a million stacks
    /// take 125 KB here, where a set of ids took 10 MB).
    defined: Vec<u64>,
    /// Processes whose maps were read since their last exec.
    maps_read: crate::FastSet<u32>,
    /// Processes already named.
    named: crate::FastSet<u32>,
    /// The processes running when the session began (`record -a`): one first met is named
    /// as it was then (a shell read late, after it exec'd its last command, was named by
    /// that command).
    at_start: Option<std::sync::Arc<crate::at_start::Snapshot>>,
}

impl Namer {
    pub fn new() -> Self {
        Self::default()
    }

    fn stack_id(&mut self, hash: u64) -> u32 {
        self.stack_ids.id(hash)
    }

    /// The definition of a stack met for the first time (None: already defined). Modules
    /// it made known wait in `modules.take_new()`.
    pub fn stack(&mut self, s: StackRecord) -> Option<FileStack> {
        let id = self.stack_id(s.hash);
        let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
        if self.defined.len() <= word {
            self.defined.resize(word + 1, 0);
        }
        if self.defined[word] & bit != 0 {
            return None;
        }
        self.defined[word] |= bit;
        if self.maps_read.insert(s.pid) {
            self.modules.learn_process(s.pid);
        }
        let (user, truncated) = self.modules.resolve_record(&s);
        Some(FileStack { id, pid: s.pid, kernel: s.kernel, user, truncated })
    }

    /// Forgets which stacks were met, once no event or stack will come (a recording's end:
    /// a heavy program's million stack hashes took 35 MB); modules and names stay. Ids
    /// start again at 0: a stack named after this would reuse an id already written.
    pub fn forget_stacks(&mut self) {
        self.stack_ids = Default::default();
        self.defined = Vec::new();
    }

    /// Readies an event for its consumer: its stack hash becomes the stack id + 1 (0: none).
    /// Returns the name of a process met for the first time (one already running when
    /// tracing began has no exec event to name it), as a rename event to take before it.
    /// (Events come in time order: one taken before its process's exec or fork is met
    /// before it.)
    pub fn event(&mut self, event: &mut Event) -> Option<Event> {
        let named = match &*event {
            Event::Alloc(a) => self.name_process(a.pid, a.ts_ns),
            Event::Free(f) => self.name_process(f.pid, f.ts_ns),
            Event::Task(t) if t.tid == t.pid && t.event != TaskEvent::Exit => {
                self.named.insert(t.pid);
                None
            }
            Event::Task(_) => None,
        };
        match event {
            Event::Alloc(a) => {
                if a.stack != 0 {
                    a.stack = u64::from(self.stack_id(a.stack)) + 1;
                }
                a.flags &= !flags::HAS_STACK;
            }
            // A new program: its maps are read again at its next stack.
            Event::Task(t) if t.event == TaskEvent::Exec => {
                self.maps_read.remove(&t.pid);
            }
            _ => {}
        }
        named
    }

    /// The name of process `pid` as a rename event, unless it was named already (at its
    /// first event, or, attached to, before it).
    pub fn name_process(&mut self, pid: u32, ts_ns: u64) -> Option<Event> {
        if pid == 0 || !self.named.insert(pid) {
            return None;
        }
        let comm = match self.at_start.as_ref().and_then(|s| s.comm(pid)) {
            Some(comm) => comm.to_string(),
            None => procfs::comm(pid, pid)?,
        };
        Some(Event::Task(Task {
            ts_ns,
            event: TaskEvent::Rename,
            flags: 0,
            pid,
            tid: pid,
            ppid: 0,
            comm,
            filename: String::new(),
        }))
    }

    /// The processes running when the session began, as they were then.
    pub fn set_at_start(&mut self, snapshot: std::sync::Arc<crate::at_start::Snapshot>) {
        self.modules.set_at_start(snapshot.clone());
        self.at_start = Some(snapshot);
    }

    pub fn exec_seen(&mut self, pid: u32, filename: &Path) {
        self.modules.learn_exec(pid, filename);
    }

    /// A forked child's frames are in its parent's files until it execs: its maps are the
    /// parent's, not what its `/proc` shows when its first stack is read (by then, often
    /// the program it exec'd).
    pub fn fork_seen(&mut self, child: u32, parent: u32) {
        if self.modules.learn_fork(child, parent) {
            self.maps_read.insert(child);
        } else {
            self.maps_read.remove(&child);
        }
    }

    pub fn file_seen(&mut self, path: &Path) {
        self.modules.learn_file(path);
    }

    pub fn maps_seen(&mut self, pid: u32, maps: crate::procfs::Maps) {
        self.modules.learn_maps(pid, maps);
    }
}

#[cfg(test)]
mod tests {
    use memtrace_common::Kind;

    use super::*;
    use crate::event::{Alloc, RawUserFrame, UserWalk};

    fn alloc(pid: u32, stack: u64) -> Event {
        Event::Alloc(Alloc {
            ts_ns: 1,
            pid,
            tid: pid,
            cpu: 0,
            kind: Kind::Malloc,
            flags: flags::HAS_STACK,
            ptr: 0x10,
            bytes_req: 1,
            bytes_alloc: 1,
            stack,
            call_site: 0,
            gfp_flags: 0,
            node: 0,
            order: 0,
            allocator: 0,
            cache: 0,
        })
    }

    /// A frame-pointer stack record of `pid` with these frames.
    fn stack_record(hash: u64, pid: u32, kernel: Vec<u64>, user: Vec<RawUserFrame>) -> StackRecord {
        StackRecord {
            hash,
            pid,
            asid: 0,
            kernel,
            user,
            walk: UserWalk::FramePointers,
            truncated: false,
            no_room: false,
            joined_kernel: false,
            miss: None,
            python_context: None,
            py_key: 0,
        }
    }

    /// Ids past the first words of the bitmap: each stack is defined once, whether its id
    /// was given by an event first or by its own record.
    #[test]
    fn every_stack_is_defined_once_whatever_met_it_first() {
        let mut namer = Namer::new();
        let me = std::process::id();
        let record = |hash: u64| stack_record(hash, me, vec![0xffff_ffff_8100_0000 + hash], vec![]);
        for hash in 1..=300u64 {
            if hash % 3 == 0 {
                // An allocation referring to the stack before its record.
                namer.event(&mut alloc(me, hash));
            }
            let stack = namer.stack(record(hash)).expect("defined at its first record");
            assert_eq!(stack.id, hash as u32 - 1);
            assert!(namer.stack(record(hash)).is_none(), "stack {hash} defined twice");
        }
        for hash in [1, 64, 65, 128, 300] {
            assert!(namer.stack(record(hash)).is_none(), "stack {hash} defined twice");
        }
        namer.forget_stacks();
        assert_eq!(namer.stack(record(7)).map(|s| s.id), Some(0), "forgotten: met afresh");
    }

    #[test]
    fn stacks_get_ids_and_processes_names_once() {
        let mut namer = Namer::new();
        let me = std::process::id();
        let ip = stacks_get_ids_and_processes_names_once as *const () as u64;
        let record = stack_record(0xabc, me, vec![], vec![RawUserFrame::Ip(ip)]);
        let stack = namer.stack(record.clone()).unwrap();
        assert_eq!(stack.id, 0);
        assert!(matches!(stack.user[0], crate::recording::FileFrame::Module { .. }), "{stack:?}");
        assert!(namer.stack(record).is_none(), "defined once");
        let mut e = alloc(me, 0xabc);
        let Some(Event::Task(t)) = namer.event(&mut e) else { panic!("a running process is named") };
        assert_eq!((t.event, t.pid), (TaskEvent::Rename, me));
        let Event::Alloc(a) = e else { unreachable!() };
        assert_eq!((a.stack, a.flags & flags::HAS_STACK), (1, 0));
        assert!(namer.event(&mut alloc(me, 0)).is_none(), "named once");
    }
}
