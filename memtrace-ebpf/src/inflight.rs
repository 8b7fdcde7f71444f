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
use memtrace_common::InFlight;

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

/// Records that the current thread entered the call `state`; false when its storage could
/// not be had (out of memory, or a program on this CPU holds the storage lock).
#[inline(always)]
pub(crate) fn enter(state: InFlight) -> bool {
    match INFLIGHT.current(true) {
        Some(p) => {
            // SAFETY: as in `current`.
            unsafe { *p = state };
            true
        }
        None => false,
    }
}

/// The current thread's call returned.
#[inline(always)]
pub(crate) fn leave() {
    if let Some(state) = current() {
        state.sp = 0;
    }
}
