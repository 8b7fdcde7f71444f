//! tracefs: where it is, mounting it when it is missing, and reading tracepoint `format`
//! files into the field offsets the probes use.
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use memtrace_common::{SlabAllocLayout, TP_HEAD_BYTES, TracepointLayout};

const CANDIDATES: &[&str] = &["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Returns the tracefs root, mounting it at /sys/kernel/tracing if no copy is mounted.
pub fn root() -> Result<PathBuf> {
    for candidate in CANDIDATES {
        if Path::new(candidate).join("events").is_dir() {
            return Ok(PathBuf::from(candidate));
        }
    }
    let target = CANDIDATES[0];
    let source = c"nodev";
    let fstype = c"tracefs";
    let target_c = std::ffi::CString::new(target)?;
    // SAFETY: all pointers are valid NUL-terminated strings; data is null.
    let rc = unsafe { libc::mount(source.as_ptr(), target_c.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        bail!("tracefs is not mounted and mounting it failed ({err}); run: mount -t tracefs nodev {target}");
    }
    Ok(PathBuf::from(target))
}

/// One field of a tracepoint record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    pub offset: u32,
    pub size: u32,
}

/// Parses the `field:` lines of a tracepoint `format` file.
pub fn parse_format(text: &str) -> Vec<Field> {
    let mut fields = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("field:") else {
            continue;
        };
        let mut decl = None;
        let mut offset = None;
        let mut size = None;
        for part in rest.split(';') {
            let part = part.trim();
            if let Some(v) = part.strip_prefix("offset:") {
                offset = v.trim().parse().ok();
            } else if let Some(v) = part.strip_prefix("size:") {
                size = v.trim().parse().ok();
            } else if !part.is_empty() && !part.starts_with("signed:") && decl.is_none() {
                decl = Some(part.to_string());
            }
        }
        let (Some(decl), Some(offset), Some(size)) = (decl, offset, size) else {
            continue;
        };
        // The name is the last identifier once array brackets are dropped
        // ("char comm[16]", "__data_loc char[] name").
        let mut bare = String::with_capacity(decl.len());
        let mut depth = 0;
        for c in decl.chars() {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ if depth == 0 => bare.push(c),
                _ => {}
            }
        }
        let decl = bare.trim();
        let name = decl.rsplit(|c: char| c.is_whitespace() || c == '*').next().unwrap_or(decl).to_string();
        fields.push(Field { name, offset, size });
    }
    fields
}

struct Event<'a> {
    name: &'a str,
    fields: Vec<Field>,
}

impl Event<'_> {
    fn load<'a>(root: &Path, name: &'a str) -> Result<Event<'a>> {
        let path = root.join("events").join(name).join("format");
        let text = fs::read_to_string(&path).with_context(|| {
            format!("tracepoint {name} is missing ({}): kernel too old or built without it", path.display())
        })?;
        Ok(Event { name, fields: parse_format(&text) })
    }

    /// Offset of `field`, which must be `align`-aligned and inside the head the probes read.
    fn offset(&self, field: &str, align: u32) -> Result<u32> {
        let f = self
            .fields
            .iter()
            .find(|f| f.name == field)
            .with_context(|| format!("tracepoint {} has no field {field}", self.name))?;
        if f.offset % align != 0 || (f.offset + f.size) as usize > TP_HEAD_BYTES {
            bail!(
                "tracepoint {} field {field} at offset {} (size {}) is laid out in a way memtrace does not read",
                self.name,
                f.offset,
                f.size
            );
        }
        Ok(f.offset)
    }
}

fn slab_layout(event: &Event<'_>) -> Result<SlabAllocLayout> {
    Ok(SlabAllocLayout {
        call_site: event.offset("call_site", 8)?,
        ptr: event.offset("ptr", 8)?,
        bytes_req: event.offset("bytes_req", 8)?,
        bytes_alloc: event.offset("bytes_alloc", 8)?,
        gfp_flags: event.offset("gfp_flags", 8)?,
        node: event.offset("node", 4)?,
    })
}

/// Reads every tracepoint layout the probes need.
pub fn layout(root: &Path) -> Result<TracepointLayout> {
    let kmalloc = Event::load(root, "kmem/kmalloc")?;
    let cache_alloc = Event::load(root, "kmem/kmem_cache_alloc")?;
    let kfree = Event::load(root, "kmem/kfree")?;
    let cache_free = Event::load(root, "kmem/kmem_cache_free")?;
    let page_alloc = Event::load(root, "kmem/mm_page_alloc")?;
    let page_free = Event::load(root, "kmem/mm_page_free")?;
    let page_free_batched = Event::load(root, "kmem/mm_page_free_batched")?;
    let exec = Event::load(root, "sched/sched_process_exec")?;
    let exit = Event::load(root, "sched/sched_process_exit")?;
    let newtask = Event::load(root, "task/task_newtask")?;
    let rename = Event::load(root, "task/task_rename")?;
    Ok(TracepointLayout {
        kmalloc: slab_layout(&kmalloc)?,
        cache_alloc: slab_layout(&cache_alloc)?,
        kfree_ptr: kfree.offset("ptr", 8)?,
        cache_free_ptr: cache_free.offset("ptr", 8)?,
        page_alloc_pfn: page_alloc.offset("pfn", 8)?,
        page_alloc_order: page_alloc.offset("order", 4)?,
        page_alloc_gfp: page_alloc.offset("gfp_flags", 8)?,
        page_alloc_migratetype: page_alloc.offset("migratetype", 4)?,
        page_free_pfn: page_free.offset("pfn", 8)?,
        page_free_order: page_free.offset("order", 4)?,
        page_free_batched_pfn: page_free_batched.offset("pfn", 8)?,
        exec_filename: exec.offset("filename", 4)?,
        exit_group_dead: exit.offset("group_dead", 1)?,
        newtask_pid: newtask.offset("pid", 4)?,
        newtask_clone_flags: newtask.offset("clone_flags", 8)?,
        rename_newcomm: rename.offset("newcomm", 1)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KMEM_CACHE_ALLOC: &str = "name: kmem_cache_alloc
ID: 659
format:
	field:unsigned short common_type;	offset:0;	size:2;	signed:0;
	field:unsigned char common_flags;	offset:2;	size:1;	signed:0;
	field:unsigned char common_preempt_count;	offset:3;	size:1;	signed:0;
	field:int common_pid;	offset:4;	size:4;	signed:1;

	field:unsigned long call_site;	offset:8;	size:8;	signed:0;
	field:const void * ptr;	offset:16;	size:8;	signed:0;
	field:__data_loc char[] name;	offset:24;	size:4;	signed:0;
	field:size_t bytes_req;	offset:32;	size:8;	signed:0;
	field:size_t bytes_alloc;	offset:40;	size:8;	signed:0;
	field:unsigned long gfp_flags;	offset:48;	size:8;	signed:0;
	field:int node;	offset:56;	size:4;	signed:1;
	field:bool accounted;	offset:60;	size:1;	signed:0;

print fmt: \"call_site=%pS\"";

    #[test]
    fn parses_fields_with_pointers_arrays_and_data_loc() {
        let fields = parse_format(KMEM_CACHE_ALLOC);
        let names: Vec<_> = fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "common_type",
                "common_flags",
                "common_preempt_count",
                "common_pid",
                "call_site",
                "ptr",
                "name",
                "bytes_req",
                "bytes_alloc",
                "gfp_flags",
                "node",
                "accounted"
            ]
        );
        let ptr = &fields[5];
        assert_eq!((ptr.offset, ptr.size), (16, 8));
        let layout = slab_layout(&Event { name: "kmem_cache_alloc", fields }).unwrap();
        assert_eq!(layout.bytes_req, 32);
        assert_eq!(layout.node, 56);
    }

    #[test]
    fn rejects_fields_outside_the_head() {
        let event = Event { name: "x", fields: vec![Field { name: "far".into(), offset: 64, size: 8 }] };
        assert!(event.offset("far", 8).is_err());
        assert!(event.offset("missing", 8).is_err());
    }

    #[test]
    fn parses_comm_arrays() {
        let fields = parse_format("\tfield:char newcomm[16];\toffset:28;\tsize:16;\tsigned:0;");
        assert_eq!(fields, [Field { name: "newcomm".into(), offset: 28, size: 16 }]);
    }
}
