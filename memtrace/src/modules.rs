//! Naming user code position-independently while the processes still live: the probes
//! report user frames as (build id, file offset) when the kernel could resolve them, else
//! as bare addresses. This table turns both into (module, file offset), learning which
//! file carries which build id from the processes' memory maps, so frames can be
//! symbolized later, after the processes are gone, from the files themselves.
use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{
    elf,
    event::RawUserFrame,
    procfs::{self, Maps},
    recording::{FileFrame, Module},
};

/// Processes whose maps are kept.
const MAX_PROCESS_MAPS: usize = 4096;

/// How often a process's maps may be re-read when an address is not in them.
const MAPS_REFRESH: Duration = Duration::from_millis(50);

const SYSTEM_DIRS: &[&str] =
    &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/usr/lib"];

struct ProcessMaps {
    maps: Maps,
    read_at: Instant,
}

#[derive(Default)]
pub struct ModuleTable {
    modules: Vec<Module>,
    by_build_id: HashMap<Vec<u8>, u32>,
    by_path: HashMap<PathBuf, u32>,
    /// Build id → a file that has it.
    catalog: HashMap<Vec<u8>, PathBuf>,
    /// File → its build id (None: it has none or cannot be read).
    file_build_ids: HashMap<PathBuf, Option<Vec<u8>>>,
    maps: HashMap<u32, ProcessMaps>,
    maps_order: std::collections::VecDeque<u32>,
    scanned_system_dirs: bool,
    /// Modules created since the last `take_new`.
    pending: Vec<u32>,
}

impl ModuleTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn modules(&self) -> &[Module] {
        &self.modules
    }

    /// Modules created since the last call, for the writer to define.
    pub fn take_new(&mut self) -> Vec<Module> {
        std::mem::take(&mut self.pending).into_iter().map(|id| self.modules[id as usize].clone()).collect()
    }

    fn file_build_id(&mut self, path: &Path) -> Option<Vec<u8>> {
        if let Some(id) = self.file_build_ids.get(path) {
            return id.clone();
        }
        let id = elf::build_id(path);
        if let Some(id) = &id {
            self.catalog.entry(id.clone()).or_insert_with(|| path.to_path_buf());
            // A module first met without a known file gets its path now (and is defined
            // again for the writer).
            if let Some(&m) = self.by_build_id.get(id)
                && self.modules[m as usize].path.is_empty()
            {
                self.modules[m as usize].path = path.to_string_lossy().into_owned();
                self.pending.push(m);
            }
        }
        self.file_build_ids.insert(path.to_path_buf(), id.clone());
        id
    }

    /// Reads the maps of `pid` (if it still lives) and learns the build ids of its files.
    pub fn learn_process(&mut self, pid: u32) -> bool {
        let Ok(maps) = Maps::read(pid) else {
            return false;
        };
        let paths: Vec<PathBuf> =
            maps.file_mappings().filter(|m| m.executable).map(|m| procfs::path_in_process(pid, &m.path)).collect();
        for path in paths {
            self.file_build_id(&path);
        }
        if self.maps.insert(pid, ProcessMaps { maps, read_at: Instant::now() }).is_none() {
            self.maps_order.push_back(pid);
            // The maps of exited processes are kept (the last word on their layout) up to a
            // bound.
            while self.maps_order.len() > MAX_PROCESS_MAPS {
                if let Some(old) = self.maps_order.pop_front() {
                    self.maps.remove(&old);
                }
            }
        }
        true
    }

    /// Learns the build id of the program a process just exec'd (from /proc while it
    /// lives, else from the exec'd file name).
    pub fn learn_exec(&mut self, pid: u32, filename: &Path) {
        // The new image replaces the old maps; read them now, the process may be short-lived.
        if !self.learn_process(pid) {
            self.maps.remove(&pid);
        }
        let exe = procfs::exe(pid).ok().map(|p| procfs::path_in_process(pid, &p));
        match exe {
            Some(exe) => {
                self.file_build_id(&exe);
            }
            None if filename.is_absolute() => {
                self.file_build_id(filename);
            }
            None => {}
        }
    }

    fn scan_system_dirs(&mut self) {
        if self.scanned_system_dirs {
            return;
        }
        self.scanned_system_dirs = true;
        for dir in SYSTEM_DIRS {
            let Ok(entries) = fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if name.contains(".so") && path.is_file() {
                    self.file_build_id(&path);
                }
            }
        }
    }

    fn module_id(&mut self, build_id: Option<Vec<u8>>, path: Option<PathBuf>) -> u32 {
        if let Some(id) = build_id.as_ref().and_then(|b| self.by_build_id.get(b)) {
            return *id;
        }
        if build_id.is_none()
            && let Some(id) = path.as_ref().and_then(|p| self.by_path.get(p))
        {
            return *id;
        }
        let id = self.modules.len() as u32;
        let path_str = path.as_ref().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        self.modules.push(Module { id, build_id: build_id.clone().unwrap_or_default(), path: path_str });
        match build_id {
            Some(b) => {
                self.by_build_id.insert(b, id);
            }
            None => {
                if let Some(p) = path {
                    self.by_path.insert(p, id);
                }
            }
        }
        self.pending.push(id);
        id
    }

    fn module_for_build_id(&mut self, pid: u32, build_id: &[u8]) -> u32 {
        if let Some(&id) = self.by_build_id.get(build_id) {
            return id;
        }
        if !self.catalog.contains_key(build_id) {
            self.learn_process(pid);
        }
        if !self.catalog.contains_key(build_id) {
            self.scan_system_dirs();
        }
        let path = self.catalog.get(build_id).cloned();
        self.module_id(Some(build_id.to_vec()), path)
    }

    fn mapping_for(&mut self, pid: u32, ip: u64) -> Option<(PathBuf, u64)> {
        let stale = self.maps.get(&pid).is_none_or(|m| m.read_at.elapsed() > MAPS_REFRESH);
        let found = self.maps.get(&pid).and_then(|m| m.maps.find(ip)).filter(|m| m.is_file()).cloned();
        let mapping = match found {
            Some(m) => Some(m),
            None if stale && self.learn_process(pid) => {
                self.maps.get(&pid).and_then(|m| m.maps.find(ip)).filter(|m| m.is_file()).cloned()
            }
            None => None,
        }?;
        Some((procfs::path_in_process(pid, &mapping.path), mapping.file_offset(ip)))
    }

    /// A user frame of process `pid` as a module and file offset, if it can be named.
    pub fn resolve(&mut self, pid: u32, frame: RawUserFrame) -> FileFrame {
        match frame {
            RawUserFrame::BuildId { build_id, offset } => {
                FileFrame::Module { module: self.module_for_build_id(pid, &build_id), offset }
            }
            RawUserFrame::Ip(ip) => match self.mapping_for(pid, ip) {
                Some((path, offset)) => {
                    let build_id = self.file_build_id(&path);
                    FileFrame::Module { module: self.module_id(build_id, Some(path)), offset }
                }
                None => FileFrame::Address(ip),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn marker() -> u64 {
        std::hint::black_box(marker as *const () as u64)
    }

    #[test]
    fn names_our_own_code_by_build_id_and_by_address_alike() {
        let pid = std::process::id();
        let ip = marker();
        let mut table = ModuleTable::new();
        let by_ip = table.resolve(pid, RawUserFrame::Ip(ip));
        let FileFrame::Module { module, offset } = by_ip else { panic!("{by_ip:?}") };
        let m = table.modules()[module as usize].clone();
        assert_eq!(m.build_id.len(), 20, "test binaries carry a GNU build id");
        let mut id = [0u8; 20];
        id.copy_from_slice(&m.build_id);
        let by_build_id = table.resolve(pid, RawUserFrame::BuildId { build_id: id, offset });
        assert_eq!(by_build_id, by_ip);
        assert_eq!(table.take_new().len(), 1);
        assert!(table.take_new().is_empty());
    }

    #[test]
    fn unknown_addresses_stay_addresses() {
        let mut table = ModuleTable::new();
        assert_eq!(table.resolve(std::process::id(), RawUserFrame::Ip(16)), FileFrame::Address(16));
    }

    #[test]
    fn a_build_id_of_a_gone_process_is_found_among_system_libraries() {
        let libc = Maps::read_self()
            .unwrap()
            .file_mappings()
            .find(|m| m.path.to_string_lossy().contains("libc.so"))
            .unwrap()
            .path
            .clone();
        let id = elf::build_id(&libc).unwrap();
        let mut table = ModuleTable::new();
        let frame = RawUserFrame::BuildId { build_id: id.clone().try_into().unwrap(), offset: 0x100 };
        // pid 0 has no maps: the catalog must come from the system directories.
        let FileFrame::Module { module, .. } = table.resolve(0, frame) else { panic!() };
        let found = &table.modules()[module as usize];
        assert_eq!(fs::canonicalize(&found.path).unwrap(), fs::canonicalize(&libc).unwrap());
    }
}
