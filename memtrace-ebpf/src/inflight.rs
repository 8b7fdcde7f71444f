//! The allocator call a thread is in: its state between the entry and the return probe,
//! kept in the thread's task-local storage (`BPF_MAP_TYPE_TASK_STORAGE`, freed with the
//! thread). Finding it is a pointer lookup in the task, where a hash map keyed by thread
//! cost an insert, a lookup and a delete (hashing, a free list) on every call. A state
//! whose `sp` is 0 stands for none. (aya-ebpf 0.2 has no task storage map: its BTF
//! definition is written out here, as aya's `btf_map_def!` writes the others.)
use core::{ffi::c_void, ptr::null_mut};

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_LOCAL_STORAGE_GET_F_CREATE, bpf_map_type::BPF_MAP_TYPE_TASK_STORAGE},
    helpers::generated,
};
use memtrace_common::{InFlight, inflight};

use crate::{context::is_traced, maps::TRACED_GEN};

/// A task storage map's BTF definition: the loader reads the map's type, key, value and
/// flags from these fields' types.
#[repr(C)]
pub(crate) struct TaskStorage<T> {
    r#type: *const [i32; BPF_MAP_TYPE_TASK_STORAGE as usize],
    key: *const i32,
    value: *const T,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; BPF_F_NO_PREALLOC as usize],
}

// SAFETY: the fields are placeholders the loader reads the types of; they are never
// dereferenced, and the map's values are reached through the kernel's helper only.
unsafe impl<T> Sync for TaskStorage<T> {}

impl<T> TaskStorage<T> {
    pub(crate) const fn new() -> Self {
        Self {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
        }
    }

    /// The current thread's value, created zeroed first when `create`.
    #[inline(always)]
    fn current(&self, create: bool) -> Option<*mut T> {
        let flags = if create { u64::from(BPF_LOCAL_STORAGE_GET_F_CREATE) } else { 0 };
        // SAFETY: the map is this definition; the task is the current one, valid while
        // this program runs.
        let p = unsafe {
            generated::bpf_task_storage_get(
                self as *const Self as *mut c_void,
                generated::bpf_get_current_task_btf(),
                null_mut(),
                flags,
            )
        } as *mut T;
        (!p.is_null()).then_some(p)
    }
}

#[unsafe(link_section = ".maps")]
#[unsafe(export_name = "INFLIGHT")]
static INFLIGHT: TaskStorage<InFlight> = TaskStorage::new();

/// The current thread's allocator call, if it is in one.
#[inline(always)]
pub(crate) fn current() -> Option<&'static mut InFlight> {
    // SAFETY: the thread's own value: a thread runs one program at a time.
    let state = unsafe { &mut *INFLIGHT.current(false)? };
    (state.sp != 0).then_some(state)
}

/// What a malloc-family probe knows of the current thread: whether its process `tgid` is
/// traced and, if so, its storage (`sp` 0: in no call).
pub(crate) enum Thread {
    Untraced,
    /// Traced; its storage, or None where the thread has none and `create` was false (it
    /// is then in no call) or none could be had (out of memory, or a program on this CPU
    /// holds the storage lock).
    Traced(Option<&'static mut InFlight>),
}

/// Whether the current thread's process `tgid` is traced, from the answer its storage
/// keeps while the traced set has not changed (one lookup, of the storage the probe needs
/// anyway), else from the traced set, the answer then kept. With `create`, under `-a`, a
/// thread without storage gets one (the entry of a call about to be recorded); otherwise
/// every thread does, to keep its answer.
#[inline(always)]
pub(crate) fn traced_thread(tgid: u32, create: bool) -> Thread {
    if config!(trace_all) != 0 {
        return if is_traced(tgid) { Thread::Traced(slot(create)) } else { Thread::Untraced };
    }
    // Read before the traced set: a change made after this read shows as a new generation
    // next time, whichever answer the set gave now.
    let generation = TRACED_GEN.get(0).copied().unwrap_or(0) as u32;
    // Every thread that calls the allocator gets storage, untraced ones too (the probes
    // of a file see every process): their answer is kept as well, one lookup per call.
    let Some(state) = slot(true) else {
        // No storage to be had: the traced set alone.
        return if is_traced(tgid) { Thread::Traced(None) } else { Thread::Untraced };
    };
    if state.traced == inflight::TRACED_UNKNOWN || state.traced_gen != generation {
        state.traced = if is_traced(tgid) { inflight::TRACED_YES } else { inflight::TRACED_NO };
        state.traced_gen = generation;
    }
    if state.traced == inflight::TRACED_YES { Thread::Traced(Some(state)) } else { Thread::Untraced }
}

/// The current thread's storage, whatever it holds; created zeroed first when `create`.
#[inline(always)]
pub(crate) fn slot(create: bool) -> Option<&'static mut InFlight> {
    // SAFETY: the thread's own value: a thread runs one program at a time.
    INFLIGHT.current(create).map(|p| unsafe { &mut *p })
}
