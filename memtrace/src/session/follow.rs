//! Following the traced processes: forks, execs and exits reach the unwinder's address
//! spaces and the sink, a followed child inherits its parent's allocator probes, an exec or
//! a dlopen brings its allocator in, and the rings' losses switch sampling on.
use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use memtrace_common::TaskEvent;

use super::{Sink, Target, Tracer, monotonic_ns, objects, overload, probe_scope, tcmalloc_transfer_num_obj};
use crate::{
    event::TaskSpace,
    probes::{self, Allocator},
    procfs,
    sizes::usable::Model,
};

impl Tracer {
    /// A process forked, exec'd or exited: address spaces, probes and the sink follow. A
    /// record read after a later one of its process (a drain late, from another CPU's
    /// ring) changes nothing it would undo; the unwinder judges that for itself (it also
    /// takes out of the probes what they installed for a late exec).
    pub(super) fn on_task(&mut self, t: &crate::event::Task, space: TaskSpace, sink: &mut dyn Sink) {
        match t.event {
            TaskEvent::Exec => {
                if let Some(u) = self.unwinder.as_mut() {
                    u.exec(t.pid, &t.filename, space, t.ts_ns, &mut self.probes);
                }
                if !self.lifecycles.began(t.pid, t.ts_ns) {
                    log::debug!("pid {}: exec of {} read after a later record of the process", t.pid, t.filename);
                    return;
                }
                sink.exec_seen(t.pid, Path::new(&t.filename));
                self.on_exec(t.pid, Path::new(&t.filename), t.ts_ns);
                if self.followed.contains(&t.pid) || matches!(self.options.target, Target::All) {
                    self.python_exec(t.pid);
                }
            }
            TaskEvent::Fork => {
                if let Some(u) = self.unwinder.as_mut() {
                    let all = matches!(self.options.target, Target::All);
                    u.fork((t.pid, t.ppid), space.asid, all, t.ts_ns, &mut self.probes);
                }
                if !self.lifecycles.began(t.pid, t.ts_ns) {
                    log::debug!("pid {}: fork read after a later record of the process", t.pid);
                    if !self.lifecycles.exited_since(t.pid, t.ts_ns) {
                        // Its exec came first: the child is followed from now on, and its
                        // program gets what the exec skipped for a process not followed.
                        let was_followed = self.followed.contains(&t.pid);
                        self.on_fork(t.pid);
                        if !was_followed && self.followed.contains(&t.pid) {
                            self.on_exec(t.pid, Path::new(""), t.ts_ns);
                            self.python_exec(t.pid);
                        }
                    }
                    return;
                }
                sink.fork_seen(t.pid, t.ppid);
                self.on_fork(t.pid);
                self.python_fork(t.pid, t.ppid);
            }
            TaskEvent::Exit if t.flags & memtrace_common::flags::GROUP_DEAD != 0 => {
                if let Some(u) = self.unwinder.as_mut() {
                    u.exit(t.pid, t.ts_ns, &mut self.probes);
                }
                if self.lifecycles.ended(t.pid, t.ts_ns) {
                    self.python_exit(t.pid);
                }
            }
            _ => {}
        }
    }

    /// Children are followed (under `--no-user` too: their Python frames are looked for
    /// at their exec; no allocator is probed there).
    pub(super) fn following(&self) -> bool {
        (self.is_command || self.options.follow_forks) && !matches!(self.options.target, Target::All)
    }

    /// Adds an allocator to the session's list (or finds it there), giving it its index.
    pub(super) fn register(&mut self, mut allocator: Allocator) -> Allocator {
        if let Some(known) =
            self.allocators.iter_mut().find(|a| a.file_id == allocator.file_id && a.prefix == allocator.prefix)
        {
            known.found = true;
            return known.clone();
        }
        let Ok(index) = u8::try_from(self.allocators.len() + 1) else {
            return allocator; // index 0: counted, sizes unknown
        };
        allocator.index = index;
        let transfer = self.target_pid.and_then(tcmalloc_transfer_num_obj);
        self.usable.set_model(index, Model::for_family(allocator.family, transfer));
        if !self.options.quiet {
            log::info!("allocator found: {}", allocator.describe());
        }
        self.allocators.push(allocator.clone());
        allocator
    }

    /// Probes `allocator` in process `pid` (0: every process); whether it was probed
    /// just now (not before, and without error).
    pub(super) fn attach(&mut self, pid: u32, allocator: &Allocator) -> bool {
        if pid == 0 && crate::probes::allocator::is_own_executable(allocator.file_id) {
            return false;
        }
        if !self.attached.insert((pid, allocator.file_id, allocator.prefix.clone())) {
            return false;
        }
        match self.probes.attach_allocator(allocator, (pid != 0).then_some(pid)) {
            Ok(()) => true,
            Err(e) => {
                if !self.options.quiet {
                    eprintln!("memtrace: not tracing {} in pid {pid}: {e:#}", allocator.object.display());
                }
                false
            }
        }
    }

    /// An allocator a process could call before it was probed (its program's own, found
    /// at the exec; a library's, found at the mapping): the first such process is kept
    /// for the recording's warnings.
    /// (`exec`: the program exec'd, for an exec's.)
    fn probed_late(&mut self, allocator: &Allocator, pid: u32, since_ns: u64, exec: Option<&Path>) {
        if allocator.index == 0 || since_ns == 0 {
            return;
        }
        let after_ns = super::monotonic_ns().saturating_sub(since_ns);
        self.late_probes.entry(allocator.index).or_insert_with(|| crate::recording::LateProbe {
            pid,
            after_ns,
            exec: exec.is_some(),
            program: exec.map(|p| p.display().to_string()).unwrap_or_default(),
            remembered: false,
        });
    }

    /// A child of a followed process: the allocators its parent has are its own. With
    /// multi links the probes already cover it (the kernel added it to the traced set at
    /// its fork), from its first instruction.
    pub(super) fn on_fork(&mut self, pid: u32) {
        // (Nothing is attached once tracing stopped: a fork read before, handled after.)
        if !self.following() || self.cutoff_ns.is_some() {
            return;
        }
        self.followed.insert(pid);
        if probe_scope(&self.probes, &self.options, Some(pid)).is_none() {
            return;
        }
        for allocator in self.allocators.clone() {
            let _ = self.attach(pid, &allocator);
        }
    }

    /// A traced process exec'd: its new program may bring another allocator (a static
    /// binary, another libc); probes already attached stay (they fire if the new program
    /// maps the same files).
    /// (`filename`: the program as the exec record names it, for a process gone before its
    /// `/proc` entry is read: a short program's allocator is still looked into, and so
    /// remembered for the command's next session.)
    /// (`exec_ns`: when it exec'd.)
    pub(super) fn on_exec(&mut self, pid: u32, filename: &Path, exec_ns: u64) {
        if !self.options.user
            || self.cutoff_ns.is_some()
            || (!self.followed.contains(&pid) && !matches!(self.options.target, Target::All))
        {
            return;
        }
        let (exe, gone) = match procfs::exe(pid) {
            Ok(exe) => (procfs::path_in_process(pid, &exe), false),
            Err(_) if filename.is_absolute() && filename.exists() => (filename.to_path_buf(), true),
            Err(_) => return,
        };
        if matches!(self.options.target, Target::All) {
            // A process gone before this is read tells nothing of its root (a chroot's
            // program, named by its path from ours, would have its libraries looked for in
            // ours): it does not stand for its program's later processes.
            let seen =
                if gone { self.checked_objects.contains(&exe) } else { !self.checked_objects.insert(exe.clone()) };
            if seen {
                return; // a program seen before: its allocator is attached for everyone
            }
        }
        // A program seen through a process's root (`/proc/PID/root/…`, a container's) is
        // that file: canonicalizing would read the root's link (`/`, for another mount
        // namespace) and name the machine's program of the same name.
        let canonical = if exe.starts_with("/proc") {
            exe.clone()
        } else {
            std::fs::canonicalize(&exe).unwrap_or_else(|_| exe.clone())
        };
        // What the new program preloads is in its own environment (`env LD_PRELOAD=... prog`).
        let preload = procfs::ld_preload(pid);
        let key = (canonical, preload);
        if let Some(resolved) = self.resolved_programs.get(&key) {
            let resolved = resolved.clone();
            self.attach_for_program(&key.0, pid, resolved, exec_ns);
            return;
        }
        // Looked into on the objects' thread: the program's first mappings, behind its exec
        // in the rings, reach the unwinder meanwhile. Until then its own allocator (a static
        // binary's, a bundled jemalloc) is not probed; the installed libraries are already.
        if let Some(waiting) = self.programs_in_flight.get_mut(&key) {
            waiting.push((pid, exec_ns));
            return;
        }
        self.programs_in_flight.insert(key.clone(), vec![(pid, exec_ns)]);
        let (canonical, preload) = key;
        if let Some(found) = self.objects.ask_program(pid, (exe, canonical), preload, &self.options.symbol_prefix) {
            self.take_found(found);
        }
    }

    /// The allocators an exec'd program uses get probes for its process. Where probes are
    /// attached per process (kernels without multi-uprobe links), a process gone before its
    /// program was looked into (a short one, seen from its exec record) gets none: its
    /// allocators are registered, probed for the next process that runs the program, and
    /// remembered for the command's next session. An allocator probed here for the first
    /// time came after the process began (`exec_ns`): it is kept as probed late.
    fn attach_for_program(&mut self, program: &Path, pid: u32, resolved: Vec<Allocator>, exec_ns: u64) {
        let scope = probe_scope(&self.probes, &self.options, Some(pid)).unwrap_or(0);
        let gone = scope != 0 && !Path::new(&format!("/proc/{scope}")).exists();
        for allocator in resolved {
            if scope == 0 && crate::probes::allocator::is_own_executable(allocator.file_id) {
                log::debug!("not probing {} for every process: memtrace's own executable", allocator.object.display());
                continue;
            }
            let allocator = self.register(allocator);
            // Gone: it ran without them.
            if gone || self.attach(scope, &allocator) {
                self.probed_late(&allocator, pid, exec_ns, Some(program));
            }
        }
    }

    /// What a look on the objects' thread found gets its probes: an object's allocators in
    /// every followed process, a program's in its process (and remembered for the
    /// program's later processes).
    fn take_found(&mut self, found: objects::Found) {
        match found {
            objects::Found::Object(allocators, mapped) => self.attach_allocators(allocators, mapped),
            objects::Found::Program { pid, canonical, preload, allocators, sure } => {
                let key = (canonical, preload);
                let pids = self.programs_in_flight.remove(&key).unwrap_or_else(|| vec![(pid, 0)]);
                let Some(allocators) = allocators else { return };
                for (pid, exec_ns) in pids {
                    self.attach_for_program(&key.0, pid, allocators.clone(), exec_ns);
                }
                let answers = if sure { &mut self.resolved_programs } else { &mut self.unsure_programs };
                answers.insert(key, allocators);
            }
        }
    }

    /// An object a followed process mapped: its allocators (its malloc family, prefixed
    /// jemallocs) get probes in every followed process. The object is looked into on a
    /// thread of its own (`objects`): the probes are attached when
    /// [`Self::attach_found_allocators`] takes the answer.
    /// (`mapped`: the process that mapped it and when, where a mapping record said so.)
    pub(super) fn check_object(&mut self, object: PathBuf, mapped: Option<(u32, u64)>) {
        // `--no-user`: no allocator is probed, whatever the processes map.
        if !self.options.user {
            return;
        }
        // Once per file, whatever it is named by: a container's libraries are named through
        // each process's root (`/proc/PID/root/…`), and under `-a` every process start
        // scanned them again. (The names are kept for the scan of the followed processes'
        // maps, which `-a` has not: there they would grow with every process started.)
        let id = probes::allocator::file_id(&object);
        let by_name = id == (0, 0) || !matches!(self.options.target, Target::All);
        if (by_name && !self.checked_objects.insert(object.clone())) || (id != (0, 0) && !self.checked_files.insert(id))
        {
            return;
        }
        let known = self.allocators.iter().any(|a| a.file_id == id && a.prefix == self.options.symbol_prefix);
        if let Some(found) = self.objects.ask(object, &self.options.symbol_prefix, known, mapped) {
            self.take_found(found);
        }
    }

    /// The allocators found in objects and programs looked into since the last call get
    /// their probes.
    pub(super) fn attach_found_allocators(&mut self) {
        for found in self.objects.found() {
            self.take_found(found);
        }
    }

    fn attach_allocators(&mut self, found: Vec<probes::Allocator>, mapped: Option<(u32, u64)>) {
        // Under `-a`, once for every process.
        let scopes: Vec<u32> = if matches!(self.options.target, Target::All) {
            vec![0]
        } else {
            self.followed.iter().map(|&p| probe_scope(&self.probes, &self.options, Some(p)).unwrap_or(0)).collect()
        };
        for allocator in found {
            let allocator = self.register(allocator);
            let mut probed = false;
            for &scope in &scopes {
                probed |= self.attach(scope, &allocator);
            }
            if probed && let Some((pid, mapped_ns)) = mapped {
                self.probed_late(&allocator, pid, mapped_ns, None);
            }
        }
    }

    /// Housekeeping between drains: allocators loaded with dlopen by followed processes
    /// (every 2 s), and the rings' losses (every 100 ms): when they overflow, sampling is
    /// switched on rather than letting events drop (`overload`).
    pub fn housekeeping(&mut self) {
        if self.options.user
            && !matches!(self.options.target, Target::All)
            && self.last_scan.elapsed() >= Duration::from_secs(2)
        {
            self.last_scan = Instant::now();
            self.scan_for_dlopened_allocators();
        }
        self.attach_found_allocators();
        self.check_overload();
    }

    /// The rings' losses (every 100 ms, also between the drains of one wake: on many CPUs
    /// one wake's drains take a second), the switch to sampling and its handover.
    pub(super) fn check_overload(&mut self) {
        if self.last_loss_check.elapsed() >= Duration::from_millis(100) {
            self.last_loss_check = Instant::now();
            self.switch_on_loss();
        }
        self.hand_over_live_blocks();
    }

    /// Whether a loss would switch to sampling now (it has not, and nothing else samples).
    pub(super) fn may_switch(&self) -> bool {
        self.degraded.is_none() && self.options.sample_bytes.is_none() && self.options.user
    }

    /// Phase one of the switch (`overload`): at the first events lost, user allocations
    /// are sampled from now on. Cheap enough (one map read) to run between the batches of
    /// a drain: on 16 CPUs a drain of every ring takes a few hundred milliseconds, and a
    /// burst overflowing them ran on unsampled meanwhile.
    pub(super) fn switch_on_loss(&mut self) {
        let lost = self.probes.lost_events().unwrap_or(self.lost_seen);
        if lost > self.lost_seen && self.may_switch() {
            let mean = overload::MEAN;
            if self.probes.set_sampling(mean).is_ok() {
                let now = monotonic_ns();
                self.overload.switch(now);
                self.degraded = Some((now, mean));
                if !self.options.quiet {
                    eprintln!(
                        "memtrace: the rings overflowed ({} events lost): sampling user allocations from now on (each byte with probability 1/{mean}); figures become estimates",
                        lost - self.lost_seen
                    );
                    if self.overload.untrackable() {
                        eprintln!(
                            "memtrace: over {} user blocks were live at once: every free is still sent, so the rings may go on overflowing",
                            overload::MAX_TRACKED
                        );
                    }
                }
            }
        }
        self.lost_seen = lost;
    }

    /// Phase two of the switch, once due: the blocks live at the switch go to the probes.
    fn hand_over_live_blocks(&mut self) {
        if let Some(blocks) = self.overload.due(self.caught_up_ns) {
            let (n, first) = (blocks.len(), !self.overload.filtering());
            match self.probes.filter_frees(blocks.into_iter()) {
                Ok(failed) => {
                    self.overload.handed_over();
                    if first {
                        log::debug!(
                            "overload: {n} live blocks handed to the probes ({failed} did not fit); only sampled blocks' frees are sent from now on"
                        );
                    }
                    if failed > 0 && !self.options.quiet {
                        eprintln!(
                            "memtrace: {failed} blocks live when sampling began did not fit in the probes' set: their frees will not be seen"
                        );
                    }
                }
                Err(e) => log::warn!("overload: handing the live blocks to the probes: {e:#}"),
            }
        }
    }

    pub(super) fn scan_for_dlopened_allocators(&mut self) {
        for pid in self.followed.clone() {
            let Ok(maps) = procfs::Maps::read(pid) else {
                self.followed.remove(&pid);
                continue;
            };
            let objects: Vec<PathBuf> = maps
                .file_mappings()
                .filter(|m| m.executable)
                .map(|m| procfs::path_in_process(pid, &m.path))
                .filter(|p| !self.checked_objects.contains(p))
                .collect();
            for object in objects {
                self.check_cuda(pid, &object);
                self.check_object(object, None);
            }
        }
    }
}
