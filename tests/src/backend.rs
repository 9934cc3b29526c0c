//! Backends in-process: a `pvcm_backend::Daemon` per host, each on its own loopback
//! addresses, with sockets in a temporary directory.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use pvcm_backend::Daemon;
use pvcm_backend::config::{Config, VmSpec};
use pvcm_backend::mux::{Policy, VmConfig};
use pvcm_wire::Gid;

/// One VM of a lab host.
#[derive(Debug, Clone)]
pub struct LabVmSpec {
    /// Name.
    pub name: String,
    /// IPv4 address (the GID is IPv4-mapped).
    pub addr: Ipv4Addr,
}

impl LabVmSpec {
    /// A VM named `name` at `addr`.
    pub fn new(name: &str, addr: Ipv4Addr) -> LabVmSpec {
        LabVmSpec {
            name: name.to_string(),
            addr,
        }
    }

    /// Its GID.
    pub fn gid(&self) -> Gid {
        Gid::from_ipv4(self.addr)
    }

    /// The mux's default view of it (CA GUID from the GID, QPNs at 0x10000).
    pub fn vm_config(&self) -> VmConfig {
        VmConfig::new(self.name.clone(), self.gid())
    }
}

/// A backend's configuration for these VMs: sockets `DIR/NAME.sock`, control socket
/// `DIR/HOST.ctl`, a fixed seed.
pub fn config(dir: &Path, host: &str, vms: &[&LabVmSpec], seed: u64) -> Config {
    let specs = vms
        .iter()
        .map(|v| VmSpec {
            socket: dir.join(format!("{}.sock", v.name)),
            vm: v.vm_config(),
            incoming: false,
            iface: None,
        })
        .collect();
    let mut c = Config::new(specs);
    c.control = Some(dir.join(format!("{host}.ctl")));
    c.seed = Some(seed);
    c.policy = Policy::Default;
    c
}

/// The socket of VM `name` in `dir`.
pub fn socket(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.sock"))
}

/// Starts a backend (panics on failure: for tests).
pub fn start(cfg: Config) -> Daemon {
    match Daemon::start(cfg) {
        Ok(d) => d,
        Err(e) => panic!("backend failed to start: {e}"),
    }
}
