//! Starting `record -- CMD` paused: the child is forked and waits on a pipe until the probes
//! are attached, then execs, so tracing starts with the command's first allocation. Exec
//! failures come back through a close-on-exec pipe, like a shell's "command not found".
use std::{
    env,
    ffi::{CString, OsStr, OsString},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum SpawnError {
    /// A name looked up in PATH was not there; a path names no file.
    #[error("{0}: {what}", what = if .0.contains('/') { "no such file" } else { "command not found" })]
    NotFound(String),
    #[error("{0}: permission denied")]
    NotExecutable(String),
    #[error("{0}: {1}")]
    Exec(String, io::Error),
    #[error("starting {0}: {1}")]
    Fork(String, io::Error),
}

impl SpawnError {
    /// The exit code a shell reports for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::NotFound(_) => 127,
            Self::NotExecutable(_) | Self::Exec(..) => 126,
            Self::Fork(..) => 1,
        }
    }
}

/// Finds `program` the way execvp does.
pub fn resolve_program(program: &OsStr) -> Result<PathBuf, SpawnError> {
    let name = program.to_string_lossy().into_owned();
    let is_exec = |p: &Path| {
        let c = CString::new(p.as_os_str().as_bytes()).ok();
        // SAFETY: c is a valid NUL-terminated path.
        c.is_some_and(|c| unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0) && p.is_file()
    };
    if program.as_bytes().contains(&b'/') {
        let p = PathBuf::from(program);
        if !p.exists() {
            return Err(SpawnError::NotFound(name));
        }
        return if is_exec(&p) { Ok(p) } else { Err(SpawnError::NotExecutable(name)) };
    }
    let path = env::var_os("PATH").unwrap_or_else(|| OsString::from("/usr/local/bin:/usr/bin:/bin"));
    let mut found_not_exec = false;
    for dir in env::split_paths(&path) {
        let candidate = dir.join(program);
        if candidate.is_file() {
            if is_exec(&candidate) {
                return Ok(candidate);
            }
            found_not_exec = true;
        }
    }
    Err(if found_not_exec { SpawnError::NotExecutable(name) } else { SpawnError::NotFound(name) })
}

/// A forked child waiting to exec.
pub struct PausedChild {
    pub pid: u32,
    pub program: PathBuf,
    go: Option<OwnedFd>,
    exec_error: OwnedFd,
    name: String,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors we now own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Forks a child that will exec `argv` once [`PausedChild::release`] is called.
pub fn spawn_paused(argv: &[OsString]) -> Result<PausedChild, SpawnError> {
    let name = argv[0].to_string_lossy().into_owned();
    let program = resolve_program(&argv[0])?;
    let to_c = |s: &OsStr| CString::new(s.as_bytes()).map_err(|e| SpawnError::Exec(name.clone(), io::Error::other(e)));
    let path_c = to_c(program.as_os_str())?;
    let args: Vec<CString> = argv.iter().map(|a| to_c(a)).collect::<Result<_, _>>()?;
    let envs: Vec<CString> = env::vars_os()
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            to_c(&kv)
        })
        .collect::<Result<_, _>>()?;
    let mut arg_ptrs: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    arg_ptrs.push(std::ptr::null());
    let mut env_ptrs: Vec<*const libc::c_char> = envs.iter().map(|e| e.as_ptr()).collect();
    env_ptrs.push(std::ptr::null());

    let (go_read, go_write) = pipe().map_err(|e| SpawnError::Fork(name.clone(), e))?;
    let (err_read, err_write) = pipe().map_err(|e| SpawnError::Fork(name.clone(), e))?;
    let go_write_fd = go_write.as_raw_fd();
    // The command runs at the niceness memtrace was started with, not at the one memtrace
    // took to drain ahead of it (a higher niceness takes no privilege).
    let restore_nice = super::priority::caller();
    // SAFETY: the child only calls async-signal-safe functions (close, read, signal,
    // setpriority, execve, write, _exit) on memory prepared before the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(SpawnError::Fork(name, io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: see above; every pointer stays valid in the child's copy of memory.
        unsafe {
            // Our copy of the write end would keep the pipe open: without it, memtrace
            // closing its end reads as EOF here.
            libc::close(go_write_fd);
            let mut byte = 0u8;
            let n = libc::read(go_read.as_raw_fd(), (&raw mut byte).cast(), 1);
            if n != 1 {
                libc::_exit(127); // memtrace went away before releasing us
            }
            // The command starts with Ctrl-C's default action, whatever memtrace was started
            // with (a background job of a script ignores SIGINT, and an ignored signal stays
            // ignored across exec): a SIGINT passed on must reach it.
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            if let Some(nice) = restore_nice {
                libc::setpriority(libc::PRIO_PROCESS, 0, nice);
            }
            libc::execve(path_c.as_ptr(), arg_ptrs.as_ptr(), env_ptrs.as_ptr());
            let errno = *libc::__errno_location();
            libc::write(err_write.as_raw_fd(), (&raw const errno).cast(), size_of::<i32>());
            libc::_exit(127);
        }
    }
    drop(go_read);
    drop(err_write);
    Ok(PausedChild { pid: pid as u32, program, go: Some(go_write), exec_error: err_read, name })
}

impl PausedChild {
    /// Lets the child exec and reports whether the exec worked.
    pub fn release(&mut self) -> Result<(), SpawnError> {
        let go = self.go.take().expect("released once");
        let byte = 1u8;
        // SAFETY: writes one byte from a valid buffer to our pipe end.
        unsafe { libc::write(go.as_raw_fd(), (&raw const byte).cast(), 1) };
        drop(go);
        let mut errno = 0i32;
        // SAFETY: reads at most 4 bytes into errno; EOF (0) means the exec succeeded and
        // closed the close-on-exec write end.
        let n = unsafe { libc::read(self.exec_error.as_raw_fd(), (&raw mut errno).cast(), size_of::<i32>()) };
        if n == size_of::<i32>() as isize {
            let mut status = 0;
            // SAFETY: reaps our own child, which exits right after reporting.
            unsafe { libc::waitpid(self.pid as i32, &mut status, 0) };
            let err = io::Error::from_raw_os_error(errno);
            return Err(match errno {
                libc::ENOENT => SpawnError::NotFound(self.name.clone()),
                libc::EACCES => SpawnError::NotExecutable(self.name.clone()),
                _ => SpawnError::Exec(self.name.clone(), err),
            });
        }
        Ok(())
    }

    /// Ends a child that will not be released (setup failed): it exits on its own once
    /// the go pipe closes; it is killed anyway, and reaped.
    pub fn abandon(mut self) {
        self.go.take();
        let mut status = 0;
        // SAFETY: signals and reaps our own child, which has not exec'd.
        unsafe {
            libc::kill(self.pid as i32, libc::SIGKILL);
            libc::waitpid(self.pid as i32, &mut status, 0);
        }
    }
}

/// Shell-style exit code of a wait status.
pub fn exit_code(status: i32) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

/// How a process ended, from its wait status: "exited with status N", or "was killed by
/// signal 11 (Segmentation fault)" (the shell's 139 names no signal).
pub fn describe_status(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exited with status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        // SAFETY: strsignal returns a static or thread-local string, read at once.
        let name = unsafe { std::ffi::CStr::from_ptr(libc::strsignal(sig)) }.to_string_lossy().into_owned();
        let core = if libc::WCOREDUMP(status) { ", core dumped" } else { "" };
        format!("was killed by signal {sig} ({name}{core})")
    } else {
        format!("ended with wait status {status:#x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ending_by_signal_names_the_signal() {
        assert_eq!(describe_status(3 << 8), "exited with status 3");
        assert_eq!(describe_status(libc::SIGSEGV), "was killed by signal 11 (Segmentation fault)");
        assert_eq!(exit_code(libc::SIGSEGV), 139);
    }

    #[test]
    fn missing_commands_are_127_like_a_shell() {
        let err = resolve_program(OsStr::new("definitely-not-a-command-xyz")).unwrap_err();
        assert_eq!(err.exit_code(), 127);
        assert_eq!(err.to_string(), "definitely-not-a-command-xyz: command not found");
        let err = resolve_program(OsStr::new("/nonexistent/cmd")).unwrap_err();
        assert_eq!(err.to_string(), "/nonexistent/cmd: no such file");
        assert_eq!(resolve_program(OsStr::new("/nonexistent/x")).unwrap_err().exit_code(), 127);
        let not_executable = std::env::temp_dir().join(format!("memtrace-not-exec-{}", std::process::id()));
        std::fs::write(&not_executable, b"#!/bin/sh\n").unwrap();
        let err = resolve_program(not_executable.as_os_str()).unwrap_err();
        std::fs::remove_file(&not_executable).unwrap();
        assert_eq!(err.exit_code(), 126);
    }

    #[test]
    fn a_released_child_runs_and_reports_its_status() {
        let mut child = spawn_paused(&["sh".into(), "-c".into(), "exit 7".into()]).unwrap();
        child.release().unwrap();
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(child.pid as i32, &mut status, 0) };
        assert_eq!(exit_code(status), 7);
    }
}
