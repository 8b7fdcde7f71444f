//! Python frames in the stacks, from outside the process. The probes walk the thread's
//! CPython frames at each allocation (`memtrace-ebpf/src/python.rs`, for the processes
//! whose interpreter [`detect`] found and described with [`layout`]) and send each frame
//! as (code object, instruction index). Here, while the process lives, each code object is
//! read once ([`code`]) and the index turned into a line ([`lines`]); then each native
//! frame of the evaluation loop is replaced by the Python frames that C call ran
//! ([`splice`]), so a stack reads `malloc ← … ← make_matrix (model.py:42) ← main
//! (train.py:88)` with the native frames of C extensions in their place.
//!
//! A Python frame is stored as a frame of a module of its own per (function, file): the
//! module's build id carries [`MODULE_MARK`] and the function's qualified name, its path the
//! file name, and the frame's offset the line. Recordings, reports, exports and `serve`
//! name it from that alone ([`function_of`]), with no symbolizer.
pub mod code;
pub mod detect;
pub mod layout;
pub mod lines;

use std::sync::Arc;

use memtrace_common::python::{PyFrame, py_frame_flags};

use crate::recording::Module;
use code::{Code, PyFunction};
use detect::{Detector, Finding, Interpreter};

/// The start of a Python module's build id.
pub const MODULE_MARK: &[u8] = b"\0python\0";

/// The build id of the module standing for function `qualname` of file `filename`.
pub fn module_build_id(qualname: &str, filename: &str) -> Vec<u8> {
    let mut id = MODULE_MARK.to_vec();
    id.extend_from_slice(qualname.as_bytes());
    id.push(0);
    id.extend_from_slice(filename.as_bytes());
    id
}

/// The Python function a module stands for (None: a native module).
pub fn function_of(module: &Module) -> Option<&str> {
    let rest = module.build_id.strip_prefix(MODULE_MARK)?;
    let name = rest.split(|&b| b == 0).next()?;
    std::str::from_utf8(name).ok()
}

/// One frame of a merged stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spliced<T> {
    Native(T),
    /// The Python frame at this index of the stack's Python frames.
    Python(usize),
}

/// Merges a native stack (innermost first) with the Python frames of the same moment:
/// each native frame `is_eval` says is a C call of the evaluation loop gives way to the
/// next group of Python frames (a group ends with a frame marked `GROUP_END`). Groups left
/// over (the native walk was cut, or a call was not recognised) follow the last frame;
/// evaluation-loop frames with no group left stay as they are.
pub fn splice<T: Copy>(native: &[T], is_eval: impl Fn(&T) -> bool, python: &[Named]) -> Vec<Spliced<T>> {
    // Group k is python[starts[k]..starts[k + 1]].
    let mut starts: Vec<usize> = vec![0];
    starts.extend(python.iter().enumerate().filter(|(_, f)| f.group_end).map(|(i, _)| i + 1));
    if starts.last() != Some(&python.len()) {
        starts.push(python.len());
    }
    let mut groups = starts.windows(2).map(|w| w[0]..w[1]).filter(|g| !g.is_empty()).peekable();
    let mut out = Vec::with_capacity(native.len() + python.len());
    for frame in native {
        match groups.peek() {
            Some(_) if is_eval(frame) => out.extend(groups.next().into_iter().flatten().map(Spliced::Python)),
            _ => out.push(Spliced::Native(*frame)),
        }
    }
    out.extend(groups.flatten().map(Spliced::Python));
    out
}

/// A Python frame, named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedFrame {
    /// Shared with the code object read (a stack's frames are named again and again).
    pub function: Arc<PyFunction>,
    /// 0: not known.
    pub line: u32,
    /// The last frame of its group: the frames one native call of the evaluation loop
    /// ran (its frame's `GROUP_END` flag; the raw frames are not kept once named).
    pub group_end: bool,
}

/// A named Python frame as stacks hold it: one pointer to a [`NamedFrame`] shared by every
/// stack showing the same function, line and group end (PyTorch's 32,768 shared Python
/// stacks held 1.55 M frames: 8 bytes each, where the frame itself took 16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named(Arc<NamedFrame>);

impl Named {
    pub fn new(function: Arc<PyFunction>, line: u32, group_end: bool) -> Self {
        Self(Arc::new(NamedFrame { function, line, group_end }))
    }
}

impl std::ops::Deref for Named {
    type Target = NamedFrame;

    fn deref(&self) -> &NamedFrame {
        &self.0
    }
}

/// What naming a stack's Python frames needs once the process may be gone: their names,
/// and where the interpreter's evaluation loop is (the native frames they replace).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonContext {
    /// One per Python frame of the stack.
    pub names: Vec<Named>,
    /// The file defining the evaluation loop, and the loop's code as file offsets.
    pub interpreter: std::path::PathBuf,
    pub eval: Vec<std::ops::Range<u64>>,
}

/// The interpreters of the processes met and the code objects read, for naming frames
/// as soon as their stack arrives (the process may exit right after).
#[derive(Default)]
pub struct PythonNames {
    detector: Detector,
    processes: crate::FastMap<u32, Option<Finding>>,
    /// By (process, address, the bytes at `co_firstlineno`).
    codes: crate::FastMap<(u32, u64, u64), Option<Code>>,
    /// The line of each (code object as above, instruction) named: a line is found by
    /// scanning the code's line table, and the same frames come back in stack after stack.
    lines: crate::FastMap<(u32, u64, u64, i32), u32>,
    /// Each named frame given out, by (function's address, line, group end): the map holds
    /// the function, so its address is not reused while the entry lives.
    interned: crate::FastMap<(usize, u32, bool), Named>,
}

/// Code objects remembered (the cache is emptied past it).
const MAX_CODES: usize = 1 << 18;
/// Processes remembered (processes that exited are kept: their last stacks may still be
/// on their way).
const MAX_PROCESSES: usize = 16384;

impl PythonNames {
    /// Looks at `pid` afresh (a new program, a library mapped) and remembers what it runs.
    pub fn detect(&mut self, pid: u32) -> Option<Finding> {
        if self.processes.len() >= MAX_PROCESSES {
            self.processes.clear();
        }
        let found = self.detector.find(pid);
        self.processes.insert(pid, found.clone());
        found
    }

    /// The interpreter of `pid` (looked for once per program).
    pub fn interpreter(&mut self, pid: u32) -> Option<&Interpreter> {
        let detector = &mut self.detector;
        match self.processes.entry(pid).or_insert_with(|| detector.find(pid)) {
            Some(Finding::Walkable(i)) => Some(i),
            _ => None,
        }
    }

    /// A code object as the probes read it. Where they could not read all of it (a name
    /// not in ASCII, a line table over a KiB), the process is read while it lives; the
    /// object read there must be the one the probe saw (the same first line, and names
    /// and line table that agree with the record), else the record's part is kept: by the
    /// time the reader gets there the object may be freed and its memory reused (a
    /// module's code is freed once the module ran), and a mix of two objects' fields
    /// would name frames with one function and another's lines.
    pub fn learn(&mut self, seen: crate::event::PyCodeSeen) {
        if self.codes.len() >= MAX_CODES {
            self.codes.clear();
        }
        let firstlineno = seen.check as i32;
        let record = Code {
            function: PyFunction::new(
                seen.qualname.as_deref().unwrap_or_default(),
                seen.filename.as_deref().unwrap_or_default(),
            ),
            firstlineno,
            linetable: seen.linetable.clone(),
            complete: seen.complete,
        };
        if seen.filename.is_some() && seen.qualname.is_some() && record.complete {
            self.codes.insert((seen.pid, seen.code, seen.check), Some(record));
            return;
        }
        let layout = self.interpreter(seen.pid).map(|i| i.layout.code);
        let read = layout.and_then(|l| code::read_code(seen.pid, seen.code, &l));
        let code = completed(&seen, record, read);
        self.codes.insert((seen.pid, seen.code, seen.check), code);
    }

    /// Names the Python frames of a stack of `pid` that just arrived.
    pub fn context(&mut self, pid: u32, frames: &[PyFrame]) -> Option<PythonContext> {
        let i = self.interpreter(pid)?;
        let (interpreter, eval) = (i.path.clone(), i.eval.clone());
        if self.interned.len() >= MAX_CODES {
            self.interned.clear();
        }
        let names = frames
            .iter()
            .map(|f| {
                let frame = NamedFrame { group_end: f.flags & py_frame_flags::GROUP_END != 0, ..self.name(pid, f) };
                // A frame whose code was not read names a function of its own each time:
                // kept apart, not to fill the map with entries never met again.
                if &*frame.function.filename == UNKNOWN_FILE {
                    return Named(Arc::new(frame));
                }
                let key = (Arc::as_ptr(&frame.function) as usize, frame.line, frame.group_end);
                self.interned.entry(key).or_insert_with(|| Named(Arc::new(frame))).clone()
            })
            .collect();
        Some(PythonContext { names, interpreter, eval })
    }

    /// The process exec'd or exited: its interpreter and code objects are looked for again.
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.codes.retain(|(p, ..), _| *p != pid);
        self.lines.retain(|(p, ..), _| *p != pid);
    }

    /// A forked child runs its parent's interpreter, at the same addresses.
    pub fn fork(&mut self, child: u32, parent: u32) {
        if let Some(found) = self.processes.get(&parent).cloned() {
            self.processes.insert(child, found);
        }
    }

    /// Names a frame of process `pid`: its code object read once, the line computed.
    pub fn name(&mut self, pid: u32, frame: &PyFrame) -> NamedFrame {
        let Some(interpreter) = self.interpreter(pid) else {
            return unknown(frame);
        };
        let (minor, layout) = (interpreter.layout.minor, interpreter.layout.code);
        if self.codes.len() >= MAX_CODES {
            self.codes.clear();
            self.lines.clear();
        }
        if self.lines.len() >= MAX_CODES * 4 {
            self.lines.clear();
        }
        let code = self.codes.entry((pid, frame.code, frame.check)).or_insert_with(|| {
            code::read_code(pid, frame.code, &layout).filter(|c| c.firstlineno == frame.check as i32)
        });
        match code {
            Some(c) => NamedFrame {
                function: Arc::clone(&c.function),
                line: *self
                    .lines
                    .entry((pid, frame.code, frame.check, frame.lasti))
                    .or_insert_with(|| lines::line_of(minor, &c.linetable, c.firstlineno, frame.lasti).unwrap_or(0)),
                group_end: false,
            },
            None => unknown(frame),
        }
    }
}

/// The code object a partial record names: the one read from the process if it is the
/// object the probe saw (same first line; its names and line table agree with what the
/// record holds), else the record's part when it has both names, else none.
fn completed(seen: &crate::event::PyCodeSeen, record: Code, read: Option<Code>) -> Option<Code> {
    let same = |c: &Code| {
        c.firstlineno == record.firstlineno
            && c.linetable.starts_with(&record.linetable)
            && seen.filename.as_deref().is_none_or(|f| f == &*c.function.filename)
            && seen.qualname.as_deref().is_none_or(|q| q == &*c.function.qualname)
    };
    let named = seen.filename.is_some() && seen.qualname.is_some();
    read.filter(same).or(named.then_some(record))
}

/// The file of a frame whose code object could not be read.
const UNKNOWN_FILE: &str = "<unknown>";

fn unknown(frame: &PyFrame) -> NamedFrame {
    NamedFrame {
        function: PyFunction::new(&format!("[python code 0x{:x}]", frame.code), UNKNOWN_FILE),
        line: 0,
        group_end: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn py(code: u64, end: bool) -> Named {
        Named::new(PyFunction::new(&format!("f{code}"), "/x.py"), 1, end)
    }

    fn show(s: &[Spliced<&str>]) -> Vec<String> {
        s.iter()
            .map(|f| match f {
                Spliced::Native(n) => n.to_string(),
                Spliced::Python(i) => format!("py{}", i + 1),
            })
            .collect()
    }

    #[test]
    fn each_eval_frame_gives_way_to_its_group() {
        let native = ["malloc", "PyList_New", "eval", "map_next", "eval", "main"];
        let python = [py(1, false), py(2, true), py(3, false), py(4, true)];
        let out = splice(&native, |f| *f == "eval", &python);
        assert_eq!(show(&out), ["malloc", "PyList_New", "py1", "py2", "map_next", "py3", "py4", "main"]);
    }

    #[test]
    fn groups_left_over_follow_and_eval_frames_left_over_stay() {
        let native = ["malloc", "eval"];
        let python = [py(1, true), py(2, true)];
        assert_eq!(show(&splice(&native, |f| *f == "eval", &python)), ["malloc", "py1", "py2"]);
        let native = ["malloc", "eval", "eval"];
        let python = [py(1, true)];
        assert_eq!(show(&splice(&native, |f| *f == "eval", &python)), ["malloc", "py1", "eval"]);
        // The last group need not be marked.
        let native = ["malloc", "eval"];
        let python = [py(1, false), py(2, false)];
        assert_eq!(show(&splice(&native, |f| *f == "eval", &python)), ["malloc", "py1", "py2"]);
    }

    #[test]
    fn a_python_module_names_its_function() {
        let m = Module { id: 3, build_id: module_build_id("K.f2", "/tmp/x.py"), path: "/tmp/x.py".into() };
        assert_eq!(function_of(&m), Some("K.f2"));
        let native = Module { id: 4, build_id: vec![1, 2, 3], path: "/lib/libc.so.6".into() };
        assert_eq!(function_of(&native), None);
    }

    /// A record the probe could not read whole is completed from the process only by the
    /// object it saw: the memory of a freed code object, or another object made at its
    /// address, must not lend it names or lines.
    #[test]
    fn a_partial_record_is_completed_only_by_the_same_object() {
        let seen = crate::event::PyCodeSeen {
            pid: 7,
            code: 0x1000,
            check: 1,
            filename: Some("typing.py".into()),
            qualname: Some("<module>".into()),
            linetable: vec![1, 2, 3],
            complete: false,
        };
        let record = Code {
            function: PyFunction::new("<module>", "typing.py"),
            firstlineno: 1,
            linetable: vec![1, 2, 3],
            complete: false,
        };
        let whole = Code { linetable: vec![1, 2, 3, 4, 5], complete: true, ..record.clone() };
        assert_eq!(completed(&seen, record.clone(), Some(whole.clone())), Some(whole.clone()));
        // Freed memory whose name pointer now reaches another string; another object at
        // the address; another line table: the record's part stays.
        for other in [
            Code { function: PyFunction::new("nd_grid", "typing.py"), ..whole.clone() },
            Code { function: PyFunction::new("<module>", "info.py"), ..whole.clone() },
            Code { firstlineno: 40, ..whole.clone() },
            Code { linetable: vec![9, 2, 3, 4], ..whole.clone() },
        ] {
            assert_eq!(completed(&seen, record.clone(), Some(other)), Some(record.clone()));
        }
        assert_eq!(completed(&seen, record.clone(), None), Some(record.clone()));
        // Names the probe could not read come from the process, from the same first line.
        let unnamed = crate::event::PyCodeSeen { qualname: None, ..seen.clone() };
        let no_name = Code { function: PyFunction::new("", "typing.py"), ..record.clone() };
        let read = Code { function: PyFunction::new("f\u{e9}", "typing.py"), ..whole.clone() };
        assert_eq!(completed(&unnamed, no_name.clone(), Some(read.clone())), Some(read.clone()));
        assert_eq!(completed(&unnamed, no_name.clone(), Some(Code { firstlineno: 2, ..read })), None);
        assert_eq!(completed(&unnamed, no_name, None), None);
    }
}
