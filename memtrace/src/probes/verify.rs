//! Verifying the programs a session uses before anything attaches, and wiring the second
//! halves of the allocation programs. Verification is most of memtrace's start-up (the
//! stack-taking programs take the kernel hundreds of milliseconds each) and the kernel
//! verifies privileged loads concurrently, so the programs are loaded on parallel threads.
//! The stack walks live in tail-called programs (`kmem_finish` and `kmem_user`,
//! `user_finish`, in the eBPF crate's `finish.rs`), installed in the program arrays their
//! first halves call before any of those attaches.
use std::time::{Duration, Instant};

use super::{
    ALLOCATOR_PROGRAMS, Probes, SESSION_PROGRAMS,
    uprobe_multi::{AttachPath, BPF_TRACE_UPROBE_MULTI, BPF_TRACE_UPROBE_SESSION},
};
use anyhow::{Context as _, Result, anyhow};
use aya::{
    maps::ProgramArray,
    programs::{Program, ProgramError},
};

/// Task lifecycle raw tracepoints.
pub(super) const TASK_PROGRAMS: [&str; 5] =
    ["task_newtask", "sched_process_exec", "sched_process_exit", "sched_process_free", "task_rename"];
/// The mapping tracker's raw syscall tracepoints.
pub(super) const MAPPING_PROGRAMS: [&str; 2] = ["sys_enter", "sys_exit"];
/// The kmem raw tracepoints.
pub(super) const KERNEL_PROGRAMS: [&str; 7] = [
    "kmalloc",
    "kmem_cache_alloc",
    "kfree",
    "kmem_cache_free",
    "mm_page_alloc",
    "mm_page_free",
    "mm_page_free_batched",
];

/// A second-half program: its name, the program array leading to it and its index there.
pub(super) type Finish = (&'static str, &'static str, u32);
/// The second half of the kmem allocation programs, and the array leading to it.
pub(super) const KERNEL_FINISH: Finish = ("kmem_finish", "KERNEL_FINISH", 0);
/// The user part of a kmem allocation's stack, which `kmem_finish` tail-calls.
pub(super) const KERNEL_USER: Finish = ("kmem_user", "KERNEL_FINISH", 1);
/// The second half of the allocation return probes, and the array leading to it.
pub(super) const USER_FINISH: Finish = ("user_finish", "USER_FINISH", 0);
/// The same for the uprobe session program.
pub(super) const SESSION_FINISH: Finish = ("user_finish_session", "SESSION_FINISH", 0);

/// One program's load: its name, the outcome, the instructions the verifier processed and
/// how long it took.
type Verified = (String, Result<(), ProgramError>, Option<u32>, Duration);

/// Which groups of programs a session will attach.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// The mapping tracker (table unwinding).
    pub mappings: bool,
    /// The kmem tracepoints.
    pub kernel: bool,
    /// The malloc family and the GPU driver.
    pub allocators: bool,
}

impl Probes {
    /// Verifies every program `plan` needs, on parallel threads.
    pub fn verify_ahead(&mut self, plan: Plan) -> Result<()> {
        let mut names: Vec<&str> = TASK_PROGRAMS.to_vec();
        if plan.mappings {
            names.extend(MAPPING_PROGRAMS);
        }
        if plan.kernel {
            names.extend(KERNEL_PROGRAMS);
            if self.kernel_stacks {
                names.push(KERNEL_FINISH.0);
                if self.user_stacks {
                    names.push(KERNEL_USER.0);
                }
            }
        }
        if plan.allocators {
            if self.attach_path == AttachPath::Session {
                // The session programs replace the entry and return programs (and their
                // second half); `alloc_session` also takes the frees.
                names.push("gpu_free");
                names.extend(SESSION_PROGRAMS.iter().filter(|&&n| n != SESSION_FINISH.0 || self.user_stacks));
            } else {
                names.extend(ALLOCATOR_PROGRAMS.iter().filter(|&&n| n != USER_FINISH.0 || self.user_stacks));
            }
        }
        let started = Instant::now();
        let verified = self.verify(&names)?;
        log::debug!("{verified} programs verified in {} ms on parallel threads", started.elapsed().as_millis());
        Ok(())
    }

    /// Loads (verifies) those of `names` not loaded yet, each on its own thread; returns
    /// how many were. The first failure is the error.
    pub(super) fn verify(&mut self, names: &[&str]) -> Result<usize> {
        let links = self.attach_path.uses_links();
        let pending: Vec<(&str, &mut Program)> =
            self.ebpf.programs_mut().filter(|(name, p)| names.contains(name) && p.fd().is_err()).collect();
        let count = pending.len();
        let results: Vec<Verified> = std::thread::scope(|scope| {
            let threads: Vec<_> = pending
                .into_iter()
                .map(|(name, program)| {
                    scope.spawn(move || {
                        let started = Instant::now();
                        let attach_type = if !links {
                            None
                        } else if SESSION_PROGRAMS.contains(&name) {
                            Some(BPF_TRACE_UPROBE_SESSION)
                        } else if ALLOCATOR_PROGRAMS.contains(&name) {
                            Some(BPF_TRACE_UPROBE_MULTI)
                        } else {
                            None
                        };
                        let loaded = load(program, attach_type);
                        let instructions = program.info().ok().and_then(|i| i.verified_instruction_count());
                        (name.to_string(), loaded, instructions, started.elapsed())
                    })
                })
                .collect();
            threads.into_iter().filter_map(|t| t.join().ok()).collect()
        });
        if results.len() != count {
            return Err(anyhow!("a thread verifying the probes panicked"));
        }
        let mut first_error = None;
        for (name, loaded, instructions, took) in results {
            match loaded {
                Ok(()) => log::debug!(
                    "{name}: {} instructions verified in {} ms",
                    instructions.map_or_else(|| "?".into(), |n| n.to_string()),
                    took.as_millis()
                ),
                Err(e) => {
                    if first_error.is_none() {
                        first_error = Some(anyhow::Error::new(e).context(format!("verifying {name}")));
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)?;
        // Every attach verifies its program first: from here on programs may run.
        self.rings_installed()?;
        Ok(count)
    }

    /// Verifies a second-half program (`finish`: program, array and index) and puts it in
    /// its program array, once.
    pub(super) fn install_finish(&mut self, (program, array, index): Finish) -> Result<()> {
        if self.finishes.contains(&program) {
            return Ok(());
        }
        self.verify(&[program])?;
        let fd = self
            .ebpf
            .program(program)
            .with_context(|| format!("program {program} missing"))?
            .fd()?
            .try_clone()
            .with_context(|| format!("duplicating the descriptor of {program}"))?;
        let mut map = ProgramArray::try_from(self.ebpf.map_mut(array).with_context(|| format!("{array} map"))?)?;
        map.set(index, &fd, 0).with_context(|| format!("installing {program} in {array}"))?;
        self.finishes.push(program);
        Ok(())
    }
}

/// Loads one program the way its attach needs: uprobes meant for multi or session links
/// with that expected attach type (the kernel lets only those attach through one, and a
/// program array only joins programs of one expected attach type).
fn load(program: &mut Program, attach_type: Option<u32>) -> Result<(), ProgramError> {
    match program {
        Program::RawTracePoint(p) => p.load(),
        Program::TracePoint(p) => p.load(),
        Program::UProbe(p) => match attach_type {
            Some(t) => p.load_with_expected_attach_type(t),
            None => p.load(),
        },
        _ => Err(ProgramError::UnexpectedProgramType),
    }
}
