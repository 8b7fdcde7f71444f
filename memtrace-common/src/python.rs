//! Python frames, shared by the probes and userspace: how a process's CPython interpreter
//! is laid out ([`PyProcInfo`], one per traced Python process in the `PY_PROCS` map,
//! written by userspace for the version it found), and the frames the probes send after a
//! stack's user frames ([`PyFrame`]: a code object and the instruction being run; the
//! names and lines are read by userspace from the code object).

/// Most Python frames walked per stack (`PyStackHeader::n` is a byte): a chain of nested
/// imports in a big package passes 128 (a pandas/pyarrow script's did).
pub const MAX_PY_FRAMES: usize = 255;

/// An offset field that does not apply to this version.
pub const PY_NONE: u16 = 0xffff;

/// The interpreter of one process, as the probes walk it. Offsets are bytes into the
/// structures named (see docs/research/cpython-frames.md for each version's values).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProcInfo {
    /// Address of `_PyRuntime`'s `autoTSSkey._key`: the pthread key under which every
    /// thread keeps its `PyThreadState`, whether or not it holds the GIL.
    pub tss_key_addr: u64,
    /// glibc's `struct pthread`: `specific_1stblock` (keys below 32) and `specific` (the
    /// second-level blocks).
    pub pthread_specific_1st: u16,
    pub pthread_specific: u16,
    /// `PyThreadState.thread_id` (= `pthread_self()` = the thread's fsbase): checks the
    /// slot held a thread state of this thread.
    pub ts_thread_id: u16,
    /// `PyThreadState` → the innermost frame (3.10 `frame`, 3.13 `current_frame`), or to
    /// the `_PyCFrame` whose `current_frame` is at `cframe_current` (3.11, 3.12).
    pub ts_frame: u16,
    pub cframe_current: u16,
    /// Frame fields: the code object, the caller, the instruction (3.10: `f_lasti`, an
    /// index; later: a pointer into the code's `co_code_adaptive` at `co_code`).
    pub f_code: u16,
    pub f_back: u16,
    pub f_instr: u16,
    /// 3.11 `is_entry`: the frame a C call of the evaluation loop started with.
    pub f_entry: u16,
    /// 3.12+ `owner`: 3 marks a frame the loop keeps on the C stack (its start).
    pub f_owner: u16,
    pub co_code: u16,
    /// The frame's globals (a module's dict): with the code object's address, it tells
    /// whether a check read earlier is this code object's (`python.rs` of the probes).
    pub f_globals: u16,
    /// 10..=13.
    pub minor: u16,
    /// `co_firstlineno`: with the frame's globals, it tells a code object from another that
    /// took its address after it was freed (see [`PyFrame::check`]).
    pub co_firstlineno: u16,
    /// What a code record carries: `co_filename`, `co_qualname` (`co_name` on 3.10),
    /// `co_linetable`, and where a compact ASCII string's characters start.
    pub co_filename: u16,
    pub co_qualname: u16,
    pub co_linetable: u16,
    pub str_ascii_data: u16,
    pub _pad: u16,
}

/// Bytes of a code object's file name and qualified name kept in a [`PyCodeRecord`].
pub const PY_FILENAME_LEN: usize = 256;
pub const PY_QUALNAME_LEN: usize = 128;
/// Bytes of its line table kept (larger tables are read from the process if it lives).
pub const PY_LINETABLE_LEN: usize = 1024;

/// A code object as the probes read it the first time a stack of its process showed it
/// (`PY_CODES_SENT` remembers which were sent): its names and line table travel with the
/// stacks, so frames are named even when the code object, or the process, is gone by the
/// time userspace reads the ring.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyCodeRecord {
    pub rtype: u8,
    pub _pad: [u8; 3],
    pub pid: u32,
    pub code: u64,
    pub check: u64,
    /// Bytes of `filename` and `qualname` with their NUL (0: not read, or not ASCII).
    pub filename_len: u16,
    pub qualname_len: u16,
    /// Bytes of `linetable` present, and the table's whole size.
    pub linetable_len: u16,
    pub _pad2: u16,
    pub linetable_size: u64,
    pub filename: [u8; PY_FILENAME_LEN],
    pub qualname: [u8; PY_QUALNAME_LEN],
    pub linetable: [u8; PY_LINETABLE_LEN],
}

/// One Python frame of a stack, innermost first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrame {
    /// The code object's address in the process.
    pub code: u64,
    /// Index of the code unit being run (-1: not started).
    pub lasti: i32,
    /// `py_frame_flags::*`.
    pub flags: u32,
    /// The code object's `co_firstlineno` (low 32 bits) and a hash of the frame's globals
    /// (high 32; where the version's layout has none, the 4 bytes after the first line):
    /// with `code`, what names the code object.
    pub check: u64,
}

/// The record of a stack's Python frames: `n` [`PyFrame`]s follow. Sent just before the
/// first stack record that names them, once per process and frames (`shared`), or once
/// per stack hash when the probes' table of frames sent is full.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyStackHeader {
    pub rtype: u8,
    /// 1: the walk stopped at its depth bound (the outer frames are missing).
    pub truncated: u8,
    pub n: u8,
    /// 1: `hash` is the key of these frames in their process, which every stack record
    /// with them names (`StackHeader::py_key`) and which is sent once; 0: the hash of the
    /// one stack they go with.
    pub shared: u8,
    pub pid: u32,
    pub hash: u64,
}

/// Seeds the key of a process's Python frames (`PyStackHeader::shared`).
pub const PY_SHARED_SEED: u64 = 0x7079_7368_6172_6564;

/// Keys of shared Python frames the probes keep at most (and userspace with them).
pub const PY_SENT_KEYS: u32 = 32768;

/// `PyFrame::flags`.
pub mod py_frame_flags {
    /// The outermost frame run by one C call of the evaluation loop: the frames up to and
    /// including it stand for one native `_PyEval_EvalFrameDefault` frame.
    pub const GROUP_END: u32 = 1;
}

const _: () = {
    assert!(core::mem::size_of::<PyProcInfo>() == 48);
    assert!(core::mem::size_of::<PyCodeRecord>() == 40 + PY_FILENAME_LEN + PY_QUALNAME_LEN + PY_LINETABLE_LEN);
    assert!(core::mem::size_of::<PyFrame>() == 24);
    assert!(core::mem::size_of::<PyStackHeader>() == 16);
};
