//! Which container a process runs in, from its cgroup: the path (cgroup v2's one line, or
//! v1's systemd or memory hierarchy), and — when the path is a Kubernetes or container
//! runtime's — the pod UID and the container id, as the kubelet's systemd and cgroupfs
//! drivers and Docker, containerd and CRI-O name them.
use std::{collections::HashMap, sync::Arc};

/// A process's cgroup and what its path says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cgroup {
    /// The cgroup path ("" when unknown: the process was gone before it was read).
    pub path: String,
    /// The Kubernetes pod UID (dashed, as `kubectl get pod -o jsonpath={.metadata.uid}`).
    pub pod_uid: Option<String>,
    /// The container id (64 hex digits, as `crictl ps` and `docker ps --no-trunc` show).
    pub container_id: Option<String>,
}

impl Cgroup {
    /// Parses a cgroup path.
    pub fn from_path(path: &str) -> Self {
        let mut pod_uid = None;
        let mut container_id = None;
        for component in path.split('/').filter(|c| !c.is_empty()) {
            if let Some(uid) = pod_uid_in(component) {
                pod_uid = Some(uid);
            }
            if let Some(id) = container_id_in(component) {
                container_id = Some(id);
            }
        }
        Self { path: path.to_string(), pod_uid, container_id }
    }

    /// The cgroup of a process from the contents of /proc/PID/cgroup.
    pub fn from_proc_file(text: &str) -> Self {
        Self::from_path(&path_in_proc_file(text))
    }
}

/// The path /proc/PID/cgroup gives: the unified hierarchy's (`0::/path`), else v1's
/// systemd hierarchy, else its memory controller's, else the first line's.
pub fn path_in_proc_file(text: &str) -> String {
    let mut fallback: Option<&str> = None;
    let mut systemd: Option<&str> = None;
    let mut memory: Option<&str> = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            return path.to_string();
        }
        if controllers == "name=systemd" {
            systemd = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            memory = Some(path);
        }
        fallback.get_or_insert(path);
    }
    systemd.or(memory).or(fallback).unwrap_or("").to_string()
}

fn is_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with `-` or `_` (the systemd driver's) between
/// the groups, normalized to dashes.
fn uuid(s: &str) -> Option<String> {
    let normalized = s.replace('_', "-");
    let groups: Vec<&str> = normalized.split('-').collect();
    let lengths: Vec<usize> = groups.iter().map(|g| g.len()).collect();
    (lengths == [8, 4, 4, 4, 12] && groups.iter().all(|g| is_hex(g))).then(|| normalized.to_ascii_lowercase())
}

/// A pod UID in one path component: `pod<uid>` (cgroupfs driver) or
/// `kubepods-<qos>-pod<uid>.slice` (systemd driver).
fn pod_uid_in(component: &str) -> Option<String> {
    let name = component.strip_suffix(".slice").unwrap_or(component);
    name.match_indices("pod").find_map(|(at, _)| uuid(&name[at + 3..]))
}

/// Runtimes' scope prefixes before a container id (systemd driver, or Docker alone).
const CONTAINER_PREFIXES: &[&str] = &["cri-containerd-", "containerd-", "docker-", "crio-", "libpod-"];

/// A container id in one path component: 64 hex digits, bare (cgroupfs driver, Docker's
/// `/docker/<id>`) or in a runtime's scope (`cri-containerd-<id>.scope`). CRI-O's
/// `crio-conmon-<id>` is its monitor, not the container.
fn container_id_in(component: &str) -> Option<String> {
    let name = component.strip_suffix(".scope").unwrap_or(component);
    let id = CONTAINER_PREFIXES.iter().find_map(|p| name.strip_prefix(p)).unwrap_or(name);
    (id.len() == 64 && is_hex(id)).then(|| id.to_ascii_lowercase())
}

/// Cgroups met so far, shared between the processes in them (bounded: forgotten all at
/// once beyond [`CgroupCache::CAPACITY`]; processes keep theirs).
#[derive(Default)]
pub struct CgroupCache {
    by_path: HashMap<String, Arc<Cgroup>>,
}

impl CgroupCache {
    const CAPACITY: usize = 16_384;

    /// The cgroup of live process `pid` (the unknown cgroup if it is gone).
    pub fn of_process(&mut self, pid: u32) -> Arc<Cgroup> {
        let path = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map(|text| path_in_proc_file(&text))
            .unwrap_or_default();
        self.intern(&path)
    }

    pub fn intern(&mut self, path: &str) -> Arc<Cgroup> {
        if let Some(c) = self.by_path.get(path) {
            return Arc::clone(c);
        }
        if self.by_path.len() >= Self::CAPACITY {
            self.by_path.clear();
        }
        let c = Arc::new(Cgroup::from_path(path));
        self.by_path.insert(path.to_string(), Arc::clone(&c));
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f3c9d2a1b0e8f7a6d5c4b3a2918f7e6d5c4b3a29180f7e6d5c4b3a291807f6e";

    #[test]
    fn kubernetes_systemd_driver_paths_give_pod_and_container() {
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_5f6a_4b7c_8d9e_0f1a2b3c4d5e.slice/cri-containerd-{ID}.scope"
        );
        let c = Cgroup::from_path(&path);
        assert_eq!(c.pod_uid.as_deref(), Some("1b2c3d4e-5f6a-4b7c-8d9e-0f1a2b3c4d5e"));
        assert_eq!(c.container_id.as_deref(), Some(ID));
        assert_eq!(c.path, path);
        // Guaranteed QoS has no QoS slice; CRI-O names its scopes crio-.
        let c = Cgroup::from_path(&format!(
            "/kubepods.slice/kubepods-pod0a1b2c3d_0000_1111_2222_333344445555.slice/crio-{ID}.scope"
        ));
        assert_eq!(c.pod_uid.as_deref(), Some("0a1b2c3d-0000-1111-2222-333344445555"));
        assert_eq!(c.container_id.as_deref(), Some(ID));
        // CRI-O's monitor is not the container.
        let conmon = Cgroup::from_path(&format!(
            "/kubepods.slice/kubepods-pod0a1b2c3d_0000_1111_2222_333344445555.slice/crio-conmon-{ID}.scope"
        ));
        assert_eq!(conmon.container_id, None);
        assert!(conmon.pod_uid.is_some());
    }

    #[test]
    fn kubernetes_cgroupfs_driver_and_docker_paths() {
        let c = Cgroup::from_path(&format!("/kubepods/besteffort/pod1b2c3d4e-5f6a-4b7c-8d9e-0f1a2b3c4d5e/{ID}"));
        assert_eq!(c.pod_uid.as_deref(), Some("1b2c3d4e-5f6a-4b7c-8d9e-0f1a2b3c4d5e"));
        assert_eq!(c.container_id.as_deref(), Some(ID));
        let docker = Cgroup::from_path(&format!("/system.slice/docker-{ID}.scope"));
        assert_eq!((docker.pod_uid.as_deref(), docker.container_id.as_deref()), (None, Some(ID)));
        let docker_v1 = Cgroup::from_path(&format!("/docker/{}", ID.to_uppercase()));
        assert_eq!(docker_v1.container_id.as_deref(), Some(ID), "ids are lower-cased");
    }

    #[test]
    fn ordinary_paths_have_neither() {
        for path in ["/user.slice/user-1000.slice/session-2.scope", "/", "", "/system.slice/podman.service"] {
            let c = Cgroup::from_path(path);
            assert_eq!((c.pod_uid, c.container_id), (None, None), "{path}");
        }
        // Not quite a UID, not quite an id.
        let c = Cgroup::from_path("/kubepods/podnot-a-uid/abc123");
        assert_eq!((c.pod_uid, c.container_id), (None, None));
    }

    #[test]
    fn proc_files_v2_and_v1() {
        assert_eq!(path_in_proc_file("0::/system.slice/memtrace.service\n"), "/system.slice/memtrace.service");
        let v1 = "12:memory:/kubepods/pod1\n11:cpu,cpuacct:/x\n1:name=systemd:/system.slice/a.service\n";
        assert_eq!(path_in_proc_file(v1), "/system.slice/a.service");
        assert_eq!(path_in_proc_file("12:memory:/m\n3:cpu:/c\n"), "/m");
        assert_eq!(path_in_proc_file("3:cpu:/c\n"), "/c");
        assert_eq!(path_in_proc_file(""), "");
        // Hybrid: the unified line wins.
        assert_eq!(path_in_proc_file("1:name=systemd:/a\n0::/b\n"), "/b");
        let own = Cgroup::from_proc_file(&std::fs::read_to_string("/proc/self/cgroup").unwrap());
        assert!(own.path.starts_with('/'), "{own:?}");
    }

    #[test]
    fn the_cache_shares_and_stays_bounded() {
        let mut cache = CgroupCache::default();
        let a = cache.intern("/a");
        assert!(Arc::ptr_eq(&a, &cache.intern("/a")));
        for i in 0..CgroupCache::CAPACITY + 10 {
            cache.intern(&format!("/x{i}"));
        }
        assert!(cache.by_path.len() <= CgroupCache::CAPACITY);
        assert_eq!(
            cache.of_process(std::process::id()).path,
            path_in_proc_file(&std::fs::read_to_string("/proc/self/cgroup").unwrap())
        );
    }
}
