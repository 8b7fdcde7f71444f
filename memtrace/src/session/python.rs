//! The Python interpreters of the traced processes: looked for when tracing a running
//! process starts, at each exec, when a process maps a `libpython`, and at fork (the child
//! runs its parent's, at the same addresses); each one found is described to the probes
//! (`Probes::set_python`) so they walk its frames, and listed in the recording with what
//! was found (an unsupported version named, never guessed). The Python frames of each
//! stack are named the moment it arrives, while the process still lives.
use std::path::Path;

use super::Tracer;
use crate::{
    event::{PyStack, StackRecord},
    probes::PythonFrames,
    python::{PythonNames, detect::Finding},
    recording::PythonMeta,
};

#[derive(Default)]
pub(super) struct PythonState {
    names: PythonNames,
    /// Processes looked at since their last exec: whether the probes walk them.
    walked: crate::FastMap<u32, bool>,
    /// What was found, once per (interpreter file, outcome).
    pub(super) found: Vec<PythonMeta>,
    /// Python frames waiting for the stack record that follows them, by stack hash.
    pending: crate::FastMap<u64, PyStack>,
    /// Python frames shared by the stacks of a process (sent once), by key, named at their
    /// first stack; at most as many as the probes' table of keys holds.
    shared: crate::FastMap<u64, SharedFrames>,
    /// The shared keys of each process: forgotten (here and in the probes) a while after
    /// its exit or exec, once the stacks read with the news have been named.
    keys_of: crate::FastMap<u32, Vec<u64>>,
    /// Keys to forget, and since when their process exited or exec'd.
    forget: std::collections::VecDeque<(std::time::Instant, Vec<u64>)>,
    /// Stacks whose Python frames have not arrived yet, and since when.
    waiting: std::collections::VecDeque<(std::time::Instant, StackRecord)>,
    /// Processes that exited, and when: frames of theirs read after the news (from another
    /// CPU's ring) go straight to be forgotten.
    exited: crate::FastMap<u32, std::time::Instant>,
}

impl PythonState {
    /// Looks for an interpreter in `pid` and tells the probes what was found (also before
    /// the session's tracer exists: a running process's interpreter is described to the
    /// probes before its allocator is probed, so its first allocations have their Python
    /// frames).
    pub(super) fn check(&mut self, pid: u32, probes: &mut crate::probes::Probes, quiet: bool) {
        let finding = self.names.detect(pid);
        let info = match &finding {
            Some(Finding::Walkable(i)) => Some(i.info),
            _ => None,
        };
        let was = self.walked.insert(pid, info.is_some()).unwrap_or(false);
        if (info.is_some() || was)
            && let Err(e) = probes.set_python(pid, info.as_ref())
        {
            log::debug!("python frames of pid {pid}: {e:#}");
        }
        if let Some(finding) = finding {
            let (version, path, walked, note) = match &finding {
                Finding::Walkable(i) => (i.version.clone(), i.path.clone(), true, String::new()),
                Finding::Unsupported { path, version, why } => (version.clone(), path.clone(), false, why.clone()),
            };
            let path = path.to_string_lossy().into_owned();
            if !self.found.iter().any(|m| m.path == path && m.walked == walked) {
                if !quiet && !walked {
                    eprintln!("memtrace: {}", finding.describe());
                }
                self.found.push(PythonMeta { version, path, walked, note });
            }
        }
    }
}

impl PythonState {
    /// Every running process whose program is a Python interpreter or maps a libpython
    /// (`-a`): its interpreter described to the probes, before the allocators are probed
    /// (as for `--pid`). Returns the processes walked: their address spaces are learned
    /// next, so that their stacks unwind in the probes from the first allocation.
    pub(super) fn scan_all(&mut self, probes: &mut crate::probes::Probes, quiet: bool) -> Vec<u32> {
        let mut found = Vec::new();
        let own = std::process::id();
        for pid in crate::procfs::all_pids() {
            if pid == own {
                continue;
            }
            let named = crate::procfs::exe(pid)
                .ok()
                .as_deref()
                .and_then(Path::file_name)
                .is_some_and(|n| n.to_string_lossy().starts_with("python"));
            let embeds =
                || std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|maps| maps.contains("/libpython"));
            if named || embeds() {
                self.check(pid, probes, quiet);
                if self.walked.get(&pid) == Some(&true) {
                    found.push(pid);
                }
            }
        }
        found
    }
}

/// Stacks waiting for their Python frames at most, and for how long.
const MAX_WAITING: usize = 4096;
const WAIT_FOR_FRAMES: std::time::Duration = std::time::Duration::from_millis(500);

/// How long the shared Python frames of a process stay after its exit or exec: its stacks
/// read in the same drain are named after the news is (and the other CPUs' rings may hold
/// more for a while).
const FORGET_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

struct SharedFrames {
    frames: PyStack,
    /// Their names (None until their first stack, or for an interpreter not known).
    context: Option<std::sync::Arc<crate::python::PythonContext>>,
    named: bool,
}

/// Python frames kept waiting for their stack (past it, the oldest are dropped).
const MAX_PENDING: usize = 65536;

/// Whether a session walks Python frames: with user stacks (under `--no-user` too: the
/// user stacks of kernel allocations name their Python lines) unless turned off.
pub(super) fn wanted(options: &super::TraceOptions) -> bool {
    options.user_stacks && options.python_frames == PythonFrames::On
}

impl Tracer {
    fn python_wanted(&self) -> bool {
        wanted(&self.options)
    }

    /// Looks for an interpreter in `pid` and tells the probes what was found.
    pub(super) fn check_python(&mut self, pid: u32) {
        if !self.python_wanted() || pid == 0 {
            return;
        }
        self.python.check(pid, &mut self.probes, self.options.quiet);
    }

    /// The interpreters met, for the recording.
    pub fn python_found(&self) -> Vec<PythonMeta> {
        self.python.found.clone()
    }

    /// A code object the probes read: its names, for the stacks that follow.
    pub(super) fn python_code(&mut self, code: crate::event::PyCodeSeen) {
        self.python.names.learn(code);
    }

    /// The Python frames of the stack whose record follows.
    pub(super) fn python_stack(&mut self, frames: PyStack) {
        if frames.shared {
            if self.python.exited.contains_key(&frames.pid) {
                self.python.forget.push_back((std::time::Instant::now(), vec![frames.hash]));
            } else {
                self.python.keys_of.entry(frames.pid).or_default().push(frames.hash);
            }
            self.python.shared.insert(frames.hash, SharedFrames { frames, context: None, named: false });
            return;
        }
        if self.python.pending.len() >= MAX_PENDING {
            self.python.pending.clear();
        }
        self.python.pending.insert(frames.hash, frames);
    }

    /// Gives a stack that just arrived its Python frames, named. False when they have not
    /// arrived yet (the thread sent them on another CPU, whose ring is read later).
    pub(super) fn name_python(&mut self, stack: &mut StackRecord) -> bool {
        if stack.py_key == 0 {
            return true;
        }
        if let Some(python) = self.python.pending.remove(&stack.py_key) {
            stack.truncated |= python.truncated;
            stack.python_context = self.python.names.context(stack.pid, &python.frames).map(std::sync::Arc::new);
            return true;
        }
        let PythonState { shared, names, .. } = &mut self.python;
        let Some(python) = shared.get_mut(&stack.py_key) else { return false };
        if !python.named {
            python.context = names.context(python.frames.pid, &python.frames.frames).map(std::sync::Arc::new);
            python.named = true;
            // Named once: the stacks that share them take the names (PyTorch's 32,768
            // shared stacks held 1.55 M raw frames, 37 MB, beside their names).
            python.frames.frames = Vec::new();
        }
        stack.truncated |= python.frames.truncated;
        stack.python_context = python.context.clone();
        true
    }

    /// Keeps a stack whose Python frames have not arrived, for [`Tracer::python_ready`];
    /// gives it back (to go on without them, cut short) when too many wait.
    pub(super) fn python_wait(&mut self, mut stack: StackRecord) -> Option<StackRecord> {
        if self.python.waiting.len() >= MAX_WAITING {
            stack.truncated = true;
            return Some(stack);
        }
        self.python.waiting.push_back((std::time::Instant::now(), stack));
        None
    }

    /// The waiting stacks whose Python frames arrived since, named, and those that waited
    /// [`WAIT_FOR_FRAMES`] (all of them when `all`), cut short without.
    pub(super) fn python_ready(&mut self, all: bool) -> Vec<StackRecord> {
        let mut ready = Vec::new();
        for (since, mut stack) in std::mem::take(&mut self.python.waiting) {
            if self.name_python(&mut stack) {
                ready.push(stack);
            } else if all || since.elapsed() >= WAIT_FOR_FRAMES {
                stack.truncated = true;
                ready.push(stack);
            } else {
                self.python.waiting.push_back((since, stack));
            }
        }
        ready
    }

    /// Forgets the shared Python frames of the processes that exec'd or exited more than
    /// [`FORGET_AFTER`] ago, here and in the probes, whose table of keys sent has room for
    /// others then.
    pub(super) fn forget_python_keys(&mut self) {
        // A process's late frames come within the reorder window; its pid may come back.
        self.python.exited.retain(|_, since| since.elapsed() < FORGET_AFTER * 10);
        while self.python.forget.front().is_some_and(|(since, _)| since.elapsed() >= FORGET_AFTER) {
            let Some((_, keys)) = self.python.forget.pop_front() else { break };
            for key in &keys {
                self.python.shared.remove(key);
            }
            if let Err(e) = self.probes.forget_python_keys(&keys) {
                log::debug!("forgetting {} shared Python stacks: {e:#}", keys.len());
            }
        }
    }

    /// The shared Python frames of `pid` (it exited or exec'd) are forgotten a while from
    /// now; those of its new program, if it exec'd, are its own.
    fn forget_later(&mut self, pid: u32) {
        if let Some(keys) = self.python.keys_of.remove(&pid) {
            self.python.forget.push_back((std::time::Instant::now(), keys));
        }
    }

    /// A process exec'd: its new program is looked at.
    pub(super) fn python_exec(&mut self, pid: u32) {
        // A pid seen exiting before, taken again (its fork may be read after this exec).
        self.python.exited.remove(&pid);
        self.python.names.forget(pid);
        self.forget_later(pid);
        if self.python.walked.remove(&pid) == Some(true) {
            let _ = self.probes.set_python(pid, None);
        }
        if matches!(self.options.target, super::Target::All) {
            // Every exec on the machine: only programs named like an interpreter are read
            // now (others that embed one are found when they map libpython).
            let exe = crate::procfs::exe(pid).ok();
            let named =
                exe.as_deref().and_then(Path::file_name).is_some_and(|n| n.to_string_lossy().starts_with("python"));
            if !named {
                return;
            }
        }
        self.check_python(pid);
    }

    /// A process mapped executable code from `path`: a libpython makes it a Python process.
    pub(super) fn python_mapped(&mut self, pid: u32, path: &Path) {
        let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
        if name.starts_with("libpython") && self.python.walked.get(&pid) != Some(&true) {
            self.check_python(pid);
        }
    }

    /// A traced process forked: the child runs the same interpreter, at the same
    /// addresses (nothing to read again).
    pub(super) fn python_fork(&mut self, child: u32, parent: u32) {
        // A new process with a pid seen exiting before.
        self.python.exited.remove(&child);
        self.python.names.fork(child, parent);
        if self.python.walked.get(&parent) == Some(&true)
            && let Some(info) = self.python.names.interpreter(child).map(|i| i.info)
        {
            self.python.walked.insert(child, true);
            if let Err(e) = self.probes.set_python(child, Some(&info)) {
                log::debug!("python frames of pid {child}: {e:#}");
            }
        }
    }

    /// A process is gone: the probes forget it (its stacks still on their way are named
    /// from what was read while it lived).
    pub(super) fn python_exit(&mut self, pid: u32) {
        if self.python.walked.remove(&pid) == Some(true) {
            let _ = self.probes.set_python(pid, None);
        }
        self.forget_later(pid);
        self.python.exited.insert(pid, std::time::Instant::now());
    }
}
