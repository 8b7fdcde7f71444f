//! Decoded events: what the probes reported, as owned Rust values, and the length-checked
//! decoding of raw ring records into them. Everything downstream (the recording file,
//! pairing, aggregation, `top`) works on these types.
//!
//! Over 500 lines: one type per record kind with its length-checked decoding, and their tests (from line 380).
use memtrace_common::{
    CacheRecord, FreeRecord, KernelAllocRecord, Kind, MappingRecord, RecordType, StackHeader, TaskEvent, TaskRecord,
    UNWIND_ANCHORED_COPY_BYTES, UnwindMiss, UserAllocRecord, UserFrame, flags, mapping_record,
    python::{PyCodeRecord, PyFrame, PyStackHeader},
    stack_flags,
};
use thiserror::Error;

/// An allocation, user or kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub cpu: u16,
    pub kind: Kind,
    pub flags: u8,
    pub ptr: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
    /// Stack hash (0: none).
    pub stack: u64,
    /// Kernel: the requesting function's address (0 for user and page allocations).
    pub call_site: u64,
    pub gfp_flags: u32,
    /// NUMA node asked for; pages: migrate type; GPU: the device ordinal (-1: not known).
    pub node: i32,
    /// Pages: allocation order. User allocations whose usable size is not known yet
    /// (no `USABLE_EXACT`): log2 of the alignment the call asked for (0: none).
    pub order: u8,
    /// User allocations: the allocator's index in the session's list plus one (0: not known).
    pub allocator: u8,
    /// kmem_cache_alloc: the slab cache (`struct kmem_cache *`; its name arrives once in a
    /// cache record and is kept in the recording's `Stats::slab_caches`); else 0.
    pub cache: u64,
}

/// A free of any space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Free {
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub cpu: u16,
    pub kind: Kind,
    pub flags: u8,
    pub ptr: u64,
    /// munmap: length in pages; page free: order.
    pub arg: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub ts_ns: u64,
    pub event: TaskEvent,
    pub flags: u8,
    pub pid: u32,
    pub tid: u32,
    pub ppid: u32,
    pub comm: String,
    /// Exec only: the file exec'd.
    pub filename: String,
}

/// A time-ordered event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Alloc(Alloc),
    Free(Free),
    Task(Task),
}

impl Task {
    /// Its process's address space ends here (exec, or the last thread's exit): the blocks
    /// live in it can no longer be freed, and its pid's later events start a new one.
    pub fn ends_address_space(&self) -> bool {
        match self.event {
            TaskEvent::Exec => true,
            TaskEvent::Exit => self.flags & memtrace_common::flags::GROUP_DEAD != 0,
            _ => false,
        }
    }
}

impl Event {
    pub fn ts_ns(&self) -> u64 {
        match self {
            Self::Alloc(a) => a.ts_ns,
            Self::Free(f) => f.ts_ns,
            Self::Task(t) => t.ts_ns,
        }
    }
}

/// A user frame: a position in an object named by build id, or a bare address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RawUserFrame {
    BuildId { build_id: [u8; 20], offset: u64 },
    Ip(u64),
}

/// The frames behind a stack hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackRecord {
    pub hash: u64,
    pub pid: u32,
    /// Kernel addresses, innermost first.
    pub kernel: Vec<u64>,
    /// User frames, innermost first.
    pub user: Vec<RawUserFrame>,
    /// How the user frames were found.
    pub walk: UserWalk,
    /// The user walk stopped before the outermost frame.
    pub truncated: bool,
    /// It stopped there because the ring had no room for a stack copy.
    pub no_room: bool,
    /// A kernel stack joined with its task's user stack (even when no kernel frame came).
    pub joined_kernel: bool,
    /// The probes' walk stopped for want of a table: where, and a copy of the stack.
    pub miss: Option<Box<StackMiss>>,
    /// The address space the user frames belong to (table walks; 0 otherwise).
    pub asid: u32,
    /// The names of the thread's Python frames, innermost first (processes running an
    /// interpreter), read when the stack arrived (`session` fills it in).
    pub python_context: Option<std::sync::Arc<crate::python::PythonContext>>,
    /// The key of the Python frames the probes sent for it (0: none).
    pub py_key: u64,
}

/// How a stack's user frames were walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UserWalk {
    /// By frame pointers (the kernel's walk): in code built without them the walk may
    /// follow a register that is not a frame pointer, so its frames need checking.
    #[default]
    FramePointers,
    /// By the modules' call-frame information: every frame is a real return address.
    CallFrameInfo,
}

/// Where the probes' user walk found no table, and the stack from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackMiss {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Where the uprobe trampoline stands in for a return address on this stack, and what
    /// for: (slot, return address), newest first.
    pub returns: Vec<(u64, u64)>,
    /// The address space (0: the process was not known to the probes).
    pub asid: u32,
    pub exact: bool,
    /// User stack bytes from `sp` up.
    pub copy: Vec<u8>,
    /// The user frames from this index on were walked from an anchor, above the gap the
    /// copy covers (0: none), and the stack pointers of the first of them (0 past the last;
    /// see `memtrace_common::UnwindMiss`).
    pub resume_at: usize,
    pub resume_sps: [u64; memtrace_common::unwind::RESUME_SPS],
    /// Their %rbp as the probes had it, and (bit k) whether the probes' frames from the k-th
    /// on hold only with it.
    pub resume_bps: [u64; memtrace_common::unwind::RESUME_SPS],
    pub bp_used: u8,
}

/// Code a process mapped (see [`memtrace_common::MappingRecord`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMapping {
    /// When it was made.
    pub ts_ns: u64,
    pub pid: u32,
    pub asid: u32,
    pub start: u64,
    pub len: u64,
    pub file_offset: u64,
    /// The path the process opened the file by; None for memory without a file.
    pub path: Option<String>,
    /// Made executable by `mprotect`, not mapped so.
    pub made_executable: bool,
}

/// What a task record says beyond the [`Task`]: the address space it concerns (fork: the
/// child's, exec: the new program's; 0 otherwise) and, for an exec, where the kernel
/// mapped the program's code and its interpreter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskSpace {
    pub asid: u32,
    pub code_start: u64,
    pub code_end: u64,
    pub interp_base: u64,
}

/// One decoded ring record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Event(Event),
    /// A task event and the address space it concerns.
    Task(Task, TaskSpace),
    Stack(StackRecord),
    /// A kernel allocation's stack whose user part is finished by the copy of the record
    /// of this hash, sent before it on the same ring ([`stack_flags::COPY_REPEAT`]).
    CopyRepeat(StackRecord, u64),
    Mapping(FileMapping),
    /// The name of a kernel slab cache.
    Cache {
        cache: u64,
        name: String,
    },
    /// A Python code object, as the probes read it.
    PyCode(PyCodeSeen),
    /// The Python frames of the stack `hash` names (its record follows).
    PyStack(PyStack),
}

/// The Python frames of a stack, innermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyStack {
    /// The key stack records name these frames by.
    pub hash: u64,
    pub pid: u32,
    pub frames: Vec<PyFrame>,
    /// The walk stopped at its depth bound.
    pub truncated: bool,
    /// Shared by the stacks of the process with these frames (else one stack's own).
    pub shared: bool,
}

/// A Python code object of process `pid` at `code` (`check`: its `co_firstlineno` in the
/// low 32 bits, a hash of its frame's globals in the high 32), with what the probes could
/// read of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyCodeSeen {
    pub pid: u32,
    pub code: u64,
    pub check: u64,
    /// None: not ASCII, or unreadable.
    pub filename: Option<String>,
    pub qualname: Option<String>,
    pub linetable: Vec<u8>,
    /// The line table is whole.
    pub complete: bool,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("empty record")]
    Empty,
    #[error("unknown record type {0}")]
    UnknownType(u8),
    #[error("record of type {rtype:?} is {len} bytes, needs {need}")]
    Truncated { rtype: RecordType, len: usize, need: usize },
    #[error("unknown allocation kind {0}")]
    UnknownKind(u8),
    #[error("unknown task event {0}")]
    UnknownTaskEvent(u8),
}

/// Copies a `T` out of the front of `bytes` after checking the length.
fn read<T: Copy>(bytes: &[u8], rtype: RecordType) -> Result<T, DecodeError> {
    let need = size_of::<T>();
    if bytes.len() < need {
        return Err(DecodeError::Truncated { rtype, len: bytes.len(), need });
    }
    // SAFETY: `bytes` holds at least size_of::<T>() bytes (checked above); T is one of the
    // plain-data records of memtrace-common, valid for any bit pattern; read_unaligned
    // imposes no alignment requirement.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

fn kind(v: u8) -> Result<Kind, DecodeError> {
    Kind::from_u8(v).ok_or(DecodeError::UnknownKind(v))
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Decodes one ring record read from CPU `cpu`'s ring.
pub fn decode(bytes: &[u8], cpu: u16) -> Result<Record, DecodeError> {
    let &first = bytes.first().ok_or(DecodeError::Empty)?;
    let rtype = RecordType::from_u8(first).ok_or(DecodeError::UnknownType(first))?;
    Ok(match rtype {
        RecordType::UserAlloc => {
            let r: UserAllocRecord = read(bytes, rtype)?;
            Record::Event(Event::Alloc(Alloc {
                ts_ns: r.ts_ns,
                pid: r.pid,
                tid: r.tid,
                cpu,
                kind: kind(r.kind)?,
                flags: r.flags,
                ptr: r.ptr,
                bytes_req: r.bytes_req,
                bytes_alloc: r.bytes_req
                    + if r.flags & flags::USABLE_EXACT != 0 { u64::from(r.bytes_extra) } else { 0 },
                stack: if r.flags & flags::HAS_STACK != 0 { r.stack } else { 0 },
                call_site: 0,
                gfp_flags: 0,
                // GPU calls: the device ordinal + 1 travels in `allocator` (0: not known).
                node: if kind(r.kind)?.is_gpu() { i32::from(r.allocator) - 1 } else { -1 },
                order: if r.flags & flags::USABLE_EXACT == 0 && r.bytes_extra.is_power_of_two() {
                    r.bytes_extra.trailing_zeros() as u8
                } else {
                    0
                },
                allocator: if kind(r.kind)?.is_gpu() { 0 } else { r.allocator },
                cache: 0,
            }))
        }
        RecordType::KernelAlloc => {
            let r: KernelAllocRecord = read(bytes, rtype)?;
            Record::Event(Event::Alloc(Alloc {
                ts_ns: r.ts_ns,
                pid: r.pid,
                tid: r.tid,
                cpu,
                kind: kind(r.kind)?,
                flags: r.flags,
                ptr: r.ptr,
                bytes_req: u64::from(r.bytes_req),
                bytes_alloc: u64::from(r.bytes_alloc),
                stack: if r.flags & flags::HAS_STACK != 0 { r.stack } else { 0 },
                call_site: r.call_site,
                gfp_flags: r.gfp_flags,
                node: r.node,
                order: r.order,
                allocator: 0,
                cache: r.cache,
            }))
        }
        RecordType::Free => {
            let r: FreeRecord = read(bytes, rtype)?;
            Record::Event(Event::Free(Free {
                ts_ns: r.ts_ns,
                pid: r.pid,
                tid: r.tid,
                cpu,
                kind: kind(r.kind)?,
                flags: r.flags,
                ptr: r.ptr,
                arg: r.arg,
            }))
        }
        RecordType::Task => {
            let r: TaskRecord = read(bytes, rtype)?;
            let event = TaskEvent::from_u8(r.event).ok_or(DecodeError::UnknownTaskEvent(r.event))?;
            let space =
                TaskSpace { asid: r.asid, code_start: r.code_start, code_end: r.code_end, interp_base: r.interp_base };
            Record::Task(
                Task {
                    ts_ns: r.ts_ns,
                    event,
                    flags: r.flags,
                    pid: r.pid,
                    tid: r.tid,
                    ppid: r.ppid,
                    comm: c_string(&r.comm),
                    filename: c_string(&r.filename),
                },
                space,
            )
        }
        RecordType::Mapping => {
            let r: MappingRecord = read(bytes, rtype)?;
            Record::Mapping(FileMapping {
                ts_ns: r.ts_ns,
                pid: r.pid,
                asid: r.asid,
                start: r.start,
                len: r.len,
                file_offset: r.file_offset,
                path: (r.flags & mapping_record::ANONYMOUS == 0).then(|| c_string(&r.path)),
                made_executable: r.flags & mapping_record::MADE_EXECUTABLE != 0,
            })
        }
        RecordType::Cache => {
            let r: CacheRecord = read(bytes, rtype)?;
            Record::Cache { cache: r.cache, name: c_string(&r.name) }
        }
        RecordType::PyStack => {
            let h: PyStackHeader = read(bytes, rtype)?;
            let need = size_of::<PyStackHeader>() + usize::from(h.n) * size_of::<PyFrame>();
            if bytes.len() < need {
                return Err(DecodeError::Truncated { rtype, len: bytes.len(), need });
            }
            let frames = bytes[size_of::<PyStackHeader>()..need]
                .chunks_exact(size_of::<PyFrame>())
                .map(|c| read::<PyFrame>(c, rtype))
                .collect::<Result<Vec<_>, _>>()?;
            Record::PyStack(PyStack {
                hash: h.hash,
                pid: h.pid,
                frames,
                truncated: h.truncated != 0,
                shared: h.shared != 0,
            })
        }
        RecordType::PyCode => {
            let r: PyCodeRecord = read(bytes, rtype)?;
            let text = |bytes: &[u8], len: u16| {
                (len > 0).then(|| c_string(&bytes[..usize::from(len).min(bytes.len())])).filter(|s| !s.is_empty())
            };
            let n = usize::from(r.linetable_len).min(r.linetable.len());
            Record::PyCode(PyCodeSeen {
                pid: r.pid,
                code: r.code,
                check: r.check,
                filename: text(&r.filename, r.filename_len),
                qualname: text(&r.qualname, r.qualname_len),
                linetable: r.linetable[..n].to_vec(),
                complete: r.linetable_size == n as u64,
            })
        }
        RecordType::Stack => {
            let h: StackHeader = read(bytes, rtype)?;
            let user_ips = h.flags & stack_flags::USER_IPS != 0;
            let kernel_bytes = usize::from(h.n_kernel) * 8;
            let frame_bytes = if user_ips { 8 } else { size_of::<UserFrame>() };
            let user_bytes = usize::from(h.n_user) * frame_bytes;
            let need = size_of::<StackHeader>() + kernel_bytes + user_bytes;
            if bytes.len() < need {
                return Err(DecodeError::Truncated { rtype, len: bytes.len(), need });
            }
            let body = &bytes[size_of::<StackHeader>()..need];
            let (kernel_part, user_part) = body.split_at(kernel_bytes);
            let kernel = kernel_part
                .chunks_exact(8)
                .map(|c| u64::from_ne_bytes(c.try_into().expect("8-byte chunk")))
                .take_while(|&ip| ip != 0)
                .collect();
            let user = if user_ips {
                user_part
                    .chunks_exact(8)
                    .map(|c| u64::from_ne_bytes(c.try_into().expect("8-byte chunk")))
                    .take_while(|&ip| ip != 0)
                    .map(RawUserFrame::Ip)
                    .collect()
            } else {
                user_part
                    .chunks_exact(size_of::<UserFrame>())
                    .map(|c| read::<UserFrame>(c, rtype))
                    .collect::<Result<Vec<_>, _>>()?
                    .into_iter()
                    .filter_map(|f| match f.status {
                        UserFrame::BUILD_ID_VALID => {
                            Some(RawUserFrame::BuildId { build_id: f.build_id, offset: f.offset_or_ip })
                        }
                        UserFrame::BUILD_ID_IP if f.offset_or_ip != 0 => Some(RawUserFrame::Ip(f.offset_or_ip)),
                        _ => None,
                    })
                    .collect()
            };
            let miss = if h.flags & stack_flags::MISS != 0 {
                let rest = &bytes[need..];
                let m: UnwindMiss = read(rest, rtype)?;
                let copy_len = m.copy_len as usize;
                let copy_need = size_of::<UnwindMiss>() + copy_len;
                if copy_len > UNWIND_ANCHORED_COPY_BYTES || rest.len() < copy_need {
                    return Err(DecodeError::Truncated { rtype, len: bytes.len(), need: need + copy_need });
                }
                Some(StackMiss {
                    ip: m.ip,
                    sp: m.sp,
                    bp: m.bp,
                    returns: m.returns.chunks_exact(2).map(|p| (p[0], p[1])).take_while(|p| p.0 != 0).collect(),
                    asid: m.asid,
                    exact: m.exact != 0,
                    copy: rest[size_of::<UnwindMiss>()..copy_need].to_vec(),
                    resume_at: m.resume_at as usize,
                    resume_sps: m.resume_sps,
                    resume_bps: m.resume_bps,
                    bp_used: m.bp_used,
                })
            } else {
                None
            };
            let repeat_of = if h.flags & stack_flags::COPY_REPEAT != 0 {
                let Some(word) = bytes.get(need..need + 8) else {
                    return Err(DecodeError::Truncated { rtype, len: bytes.len(), need: need + 8 });
                };
                u64::from_ne_bytes(word.try_into().expect("8 bytes"))
            } else {
                0
            };
            let stack = StackRecord {
                hash: h.hash,
                pid: h.pid,
                kernel,
                user,
                walk: if user_ips { UserWalk::CallFrameInfo } else { UserWalk::FramePointers },
                truncated: h.flags & stack_flags::TRUNCATED != 0,
                no_room: h.flags & stack_flags::NO_ROOM != 0,
                joined_kernel: h.flags & stack_flags::KERNEL != 0,
                miss: miss.map(Box::new),
                asid: h.asid,
                python_context: None,
                py_key: h.py_key,
            };
            if h.flags & stack_flags::COPY_REPEAT != 0 {
                Record::CopyRepeat(stack, repeat_of)
            } else {
                Record::Stack(stack)
            }
        }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn bytes_of<T: Copy>(value: &T) -> Vec<u8> {
        // SAFETY: T is a padding-free plain-data record; viewing it as bytes is sound.
        unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    fn user_alloc() -> UserAllocRecord {
        UserAllocRecord {
            rtype: RecordType::UserAlloc as u8,
            kind: Kind::Calloc as u8,
            flags: flags::HAS_STACK | flags::USABLE_EXACT,
            allocator: 0,
            pid: 10,
            tid: 11,
            bytes_extra: 8,
            ts_ns: 1000,
            ptr: 0x5555_0000,
            bytes_req: 40,
            stack: 0xabcd,
        }
    }

    #[test]
    fn decodes_a_user_allocation() {
        let rec = decode(&bytes_of(&user_alloc()), 3).unwrap();
        let Record::Event(Event::Alloc(a)) = rec else { panic!("{rec:?}") };
        assert_eq!((a.kind, a.bytes_req, a.bytes_alloc, a.stack, a.cpu), (Kind::Calloc, 40, 48, 0xabcd, 3));
    }

    #[test]
    fn a_stack_hash_without_the_flag_is_ignored() {
        let mut r = user_alloc();
        r.flags = 0;
        let Record::Event(Event::Alloc(a)) = decode(&bytes_of(&r), 0).unwrap() else { panic!() };
        assert_eq!(a.stack, 0);
    }

    #[test]
    fn every_short_prefix_is_rejected() {
        let bytes = bytes_of(&user_alloc());
        for len in 1..bytes.len() {
            assert_eq!(
                decode(&bytes[..len], 0),
                Err(DecodeError::Truncated { rtype: RecordType::UserAlloc, len, need: 48 })
            );
        }
        assert_eq!(decode(&[], 0), Err(DecodeError::Empty));
        assert_eq!(decode(&[99; 64], 0), Err(DecodeError::UnknownType(99)));
    }

    #[test]
    fn unknown_kinds_are_errors() {
        let mut r = user_alloc();
        r.kind = 200;
        assert_eq!(decode(&bytes_of(&r), 0), Err(DecodeError::UnknownKind(200)));
    }

    #[test]
    fn decodes_stacks_with_both_parts() {
        let header = StackHeader {
            rtype: RecordType::Stack as u8,
            flags: 0,
            n_kernel: 2,
            n_user: 2,
            pid: 7,
            hash: 99,
            asid: 0,
            _pad: 0,
            py_key: 0,
        };
        let mut bytes = bytes_of(&header);
        bytes.extend(0xffff_ffff_8100_0000u64.to_ne_bytes());
        bytes.extend(0xffff_ffff_8200_0000u64.to_ne_bytes());
        let valid = UserFrame { status: UserFrame::BUILD_ID_VALID, build_id: [7; 20], offset_or_ip: 0x1234 };
        let ip = UserFrame { status: UserFrame::BUILD_ID_IP, build_id: [0; 20], offset_or_ip: 0x7f00_0000_1000 };
        bytes.extend(bytes_of(&valid));
        bytes.extend(bytes_of(&ip));
        let Record::Stack(s) = decode(&bytes, 0).unwrap() else { panic!() };
        assert_eq!(s.kernel, [0xffff_ffff_8100_0000, 0xffff_ffff_8200_0000]);
        assert_eq!(
            s.user,
            [RawUserFrame::BuildId { build_id: [7; 20], offset: 0x1234 }, RawUserFrame::Ip(0x7f00_0000_1000)]
        );
        assert!(!s.truncated && !s.joined_kernel && s.miss.is_none());
        // One byte short of the last frame.
        assert!(matches!(decode(&bytes[..bytes.len() - 1], 0), Err(DecodeError::Truncated { .. })));
    }

    #[test]
    fn decodes_python_frames_and_code_records() {
        let header =
            PyStackHeader { rtype: RecordType::PyStack as u8, truncated: 1, n: 2, shared: 0, pid: 7, hash: 99 };
        let mut bytes = bytes_of(&header);
        let frames = [
            PyFrame { code: 0x7f00_0000_1000, lasti: 12, flags: 0, check: 3 },
            PyFrame { code: 0x7f00_0000_2000, lasti: -1, flags: 1, check: 9 },
        ];
        for f in &frames {
            bytes.extend(bytes_of(f));
        }
        let Record::PyStack(p) = decode(&bytes, 0).unwrap() else { panic!() };
        assert_eq!((p.hash, p.pid, p.truncated), (99, 7, true));
        assert_eq!(p.frames, frames);
        assert!(matches!(decode(&bytes[..bytes.len() - 1], 0), Err(DecodeError::Truncated { .. })));

        // SAFETY: PyCodeRecord is plain data; all-zero is a valid value.
        let mut code: PyCodeRecord = unsafe { std::mem::zeroed() };
        code.rtype = RecordType::PyCode as u8;
        code.pid = 7;
        code.code = 0x7f00_0000_1000;
        code.check = 3;
        code.filename[..6].copy_from_slice(b"a.py\0\0");
        code.filename_len = 5;
        code.qualname[..2].copy_from_slice(b"f\0");
        code.qualname_len = 2;
        code.linetable[..3].copy_from_slice(&[1, 2, 3]);
        code.linetable_len = 3;
        code.linetable_size = 10;
        let Record::PyCode(c) = decode(&bytes_of(&code), 0).unwrap() else { panic!() };
        assert_eq!(c.filename.as_deref(), Some("a.py"));
        assert_eq!(c.qualname.as_deref(), Some("f"));
        assert_eq!((c.linetable.as_slice(), c.complete), (&[1u8, 2, 3][..], false));
        code.filename_len = 0;
        let Record::PyCode(c) = decode(&bytes_of(&code), 0).unwrap() else { panic!() };
        assert_eq!(c.filename, None);
        assert!(matches!(decode(&bytes_of(&code)[..100], 0), Err(DecodeError::Truncated { .. })));
    }

    /// A table walk's stack record of process 7: its header, one kernel frame and the user
    /// addresses (what follows them is the caller's).
    fn walked_record(flags: u8, hash: u64, kernel: u64, user: &[u64]) -> Vec<u8> {
        let header = StackHeader {
            rtype: RecordType::Stack as u8,
            flags: stack_flags::USER_IPS | stack_flags::KERNEL | flags,
            n_kernel: 1,
            n_user: user.len() as u16,
            pid: 7,
            hash,
            asid: 5,
            _pad: 0,
            py_key: 0,
        };
        let mut bytes = bytes_of(&header);
        bytes.extend(kernel.to_ne_bytes());
        for ip in user {
            bytes.extend(ip.to_ne_bytes());
        }
        bytes
    }

    fn miss_record(copy_len: u32, copy: &[u8]) -> Vec<u8> {
        let mut bytes = walked_record(stack_flags::MISS, 99, 0xffff_ffff_8100_0000, &[0x40_1000, 0x40_2000]);
        let miss =
            UnwindMiss { ip: 0x40_2000, sp: 0x7ffc_0000, bp: 1, asid: 3, exact: 0, copy_len, ..Default::default() };
        bytes.extend(bytes_of(&miss));
        bytes.extend(copy);
        bytes
    }

    #[test]
    fn decodes_unwound_stacks_with_a_stack_copy() {
        let bytes = miss_record(4, &[1, 2, 3, 4]);
        let Record::Stack(s) = decode(&bytes, 0).unwrap() else { panic!() };
        assert_eq!(s.user, [RawUserFrame::Ip(0x40_1000), RawUserFrame::Ip(0x40_2000)]);
        assert!(s.joined_kernel && !s.truncated);
        let miss = s.miss.unwrap();
        assert_eq!((miss.ip, miss.sp, miss.asid, miss.exact), (0x40_2000, 0x7ffc_0000, 3, false));
        assert_eq!(miss.copy, [1, 2, 3, 4]);
        // Every cut is an error, never a short copy; so is a length past the protocol's.
        for len in 1..bytes.len() {
            assert!(matches!(decode(&bytes[..len], 0), Err(DecodeError::Truncated { .. })), "{len}");
        }
        let huge = miss_record(UNWIND_ANCHORED_COPY_BYTES as u32 + 1, &vec![0; UNWIND_ANCHORED_COPY_BYTES + 1]);
        assert!(matches!(decode(&huge, 0), Err(DecodeError::Truncated { .. })));
    }

    /// A kernel allocation's stack finished by an earlier copy of its syscall: its frames,
    /// then the hash of that copy's record; never read as a copy of its own.
    #[test]
    fn decodes_a_stack_that_refers_to_an_earlier_copy() {
        let mut bytes = walked_record(stack_flags::COPY_REPEAT, 100, 0xffff_ffff_8100_0040, &[0x40_1000]);
        bytes.extend(99u64.to_ne_bytes());
        let Record::CopyRepeat(s, of) = decode(&bytes, 0).unwrap() else { panic!() };
        assert_eq!(of, 99);
        assert_eq!(
            (s.hash, s.kernel.as_slice(), s.user.as_slice()),
            (100, &[0xffff_ffff_8100_0040][..], &[RawUserFrame::Ip(0x40_1000)][..])
        );
        assert!(s.miss.is_none() && !s.truncated && s.joined_kernel);
        for len in 1..bytes.len() {
            assert!(matches!(decode(&bytes[..len], 0), Err(DecodeError::Truncated { .. })), "{len}");
        }
    }

    #[test]
    fn decodes_task_records_with_names() {
        let mut r = TaskRecord { event: TaskEvent::Exec as u8, pid: 5, tid: 5, ts_ns: 9, ..Default::default() };
        r.comm[..4].copy_from_slice(b"prog");
        r.filename[..9].copy_from_slice(b"/bin/prog");
        let Record::Task(t, _) = decode(&bytes_of(&r), 0).unwrap() else { panic!() };
        assert_eq!((t.event, t.comm.as_str(), t.filename.as_str()), (TaskEvent::Exec, "prog", "/bin/prog"));
    }
}
