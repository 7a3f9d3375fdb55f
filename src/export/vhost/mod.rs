//! vhost-user-blk: a dmkit device as a VM's disk, with no kernel module and no
//! NBD in the path. `dmkit attach NAME --vhost-user SOCKET` listens on SOCKET;
//! QEMU (`-chardev socket,path=SOCKET,reconnect=1 -device vhost-user-blk-pci`),
//! Cloud Hypervisor or crosvm connect to it, one at a time, again after each
//! disconnect, and to the next daemon after a restart (`serve --restore`
//! listens on the same path).

pub mod blk;

use crate::mapper::Device;
use crate::sync::Unpoison;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

/// What a device's block device field says while it is attached here.
fn attached_as(socket: &Path) -> String {
    format!("vhost-user:{}", socket.display())
}

struct Attached {
    dev: Arc<Device>,
    socket: PathBuf,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the control thread and a device's server thread share.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    /// The connected frontend's connection and backend, to cut it at a forced
    /// detach.
    conn: Mutex<Option<(ShutdownHandle, blk::BlkBackend)>>,
}

/// The daemon's devices attached as vhost-user-blk backends.
#[derive(Default)]
pub struct Frontend {
    attached: Mutex<Vec<Attached>>,
    /// Devices to attach when a table is resumed on them (`serve --vhost-user
    /// NAME=SOCKET`).
    wanted: Mutex<Vec<(String, PathBuf)>>,
    disabled: bool,
}

impl Frontend {
    /// A frontend that refuses to attach anything (fuzzing the control protocol).
    pub fn disabled() -> Frontend {
        Frontend {
            disabled: true,
            ..Frontend::default()
        }
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Attached>> {
        self.attached.lock().unpoisoned()
    }

    /// The attached devices and their sockets (for the state file).
    pub fn sockets(&self) -> Vec<(Arc<Device>, PathBuf)> {
        self.list()
            .iter()
            .map(|a| (a.dev.clone(), a.socket.clone()))
            .collect()
    }

    /// Whether `dev` is attached here.
    pub fn has(&self, dev: &Arc<Device>) -> bool {
        self.list().iter().any(|a| Arc::ptr_eq(&a.dev, dev))
    }

    /// Attach device NAME at SOCKET when a table is resumed on it.
    pub fn want(&self, name: &str, socket: PathBuf) {
        self.wanted.lock().unpoisoned().push((name.to_string(), socket));
    }

    /// The socket `serve --vhost-user` named for `name`.
    pub fn wanted(&self, name: &str) -> Option<PathBuf> {
        let w = self.wanted.lock().unpoisoned();
        w.iter().find(|(n, _)| n == name).map(|(_, s)| s.clone())
    }

    /// Listen for a frontend on `socket`, serving `dev` to it. The socket's path.
    pub fn attach(&self, dev: &Arc<Device>, socket: &Path) -> Result<String, String> {
        if self.disabled {
            return Err("this daemon attaches no devices".into());
        }
        let name = dev.name();
        if let Some(b) = dev.block_device() {
            return Err(format!("{name}: already attached as {b}"));
        }
        if dev.size_sectors() == 0 {
            return Err(format!(
                "{name}: has no table to serve (load and resume one first)"
            ));
        }
        let socket = std::path::absolute(socket).map_err(|e| format!("{}: {e}", socket.display()))?;
        let mut list = self.list();
        if let Some(a) = list.iter().find(|a| a.socket == socket) {
            return Err(format!("{}: already serves {}", socket.display(), a.dev.name()));
        }
        let listener = listen(&socket)?;
        let shared = Arc::new(Shared::default());
        let thread = {
            let (dev, shared, socket) = (dev.clone(), shared.clone(), socket.clone());
            std::thread::Builder::new()
                .name(format!("vhost {name}"))
                .spawn(move || serve(&dev, listener, &socket, &shared))
                .map_err(|e| format!("{name}: starting its vhost-user thread: {e}"))?
        };
        dev.set_block_device(Some(attached_as(&socket)));
        tracing::info!("{name}: serving vhost-user-blk on {}", socket.display());
        list.push(Attached {
            dev: dev.clone(),
            socket: socket.clone(),
            shared,
            thread: Some(thread),
        });
        Ok(socket.display().to_string())
    }

    /// Stop serving `dev`. Refused while a frontend is connected, unless
    /// `force` (the guest's I/O then waits until it reconnects to a socket
    /// attached again).
    /// Whether `dev` was attached here.
    pub fn detach(&self, dev: &Arc<Device>, force: bool) -> Result<bool, String> {
        let mut list = self.list();
        let Some(i) = list.iter().position(|a| Arc::ptr_eq(&a.dev, dev)) else {
            return Ok(false);
        };
        let a = &list[i];
        {
            let conn = a.shared.conn.lock().unpoisoned();
            if let Some((c, backend)) = conn.as_ref() {
                if !force {
                    return Err(format!(
                        "Device or resource busy: {} is attached at {}, where a virtual machine is connected \
                         (stop it, or detach --force)",
                        dev.name(),
                        a.socket.display()
                    ));
                }
                if !backend.quiesce() {
                    tracing::warn!(
                        "{}: a batch of requests did not end in 60 s; cutting the connection",
                        dev.name()
                    );
                }
                c.shutdown();
            }
        }
        let mut a = list.remove(i);
        drop(list);
        a.shared.stop.store(true, Ordering::SeqCst);
        // wake the thread's accept with a connection of our own
        let _ = UnixStream::connect(&a.socket);
        if let Some(t) = a.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&a.socket);
        dev.set_block_device(None);
        tracing::info!("{}: vhost-user-blk on {} stopped", dev.name(), a.socket.display());
        Ok(true)
    }
}

/// Bind `socket`. A socket file nobody listens on (a daemon that was killed) is
/// replaced; any other file, or a socket in use, is refused.
fn listen(socket: &Path) -> Result<UnixListener, String> {
    let at = socket.display();
    match std::fs::symlink_metadata(socket) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(format!("{at}: exists and is not a socket"));
        }
        Ok(_) if UnixStream::connect(socket).is_ok() => {
            return Err(format!("{at}: another program listens on it"));
        }
        Ok(_) => std::fs::remove_file(socket).map_err(|e| format!("{at}: removing the stale socket: {e}"))?,
        Err(_) => {}
    }
    UnixListener::bind(socket).map_err(|e| format!("{at}: {e}"))
}

/// Serve frontends on `listener` one after another until detached.
fn serve(dev: &Arc<Device>, listener: UnixListener, socket: &Path, shared: &Shared) {
    let name = dev.name();
    let mut listener = vhost::vhost_user::Listener::from(listener);
    while !shared.stop.load(Ordering::SeqCst) {
        let backend = match blk::BlkBackend::new(dev.clone()) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!("{name}: vhost-user-blk: {e}");
                return;
            }
        };
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut daemon = match VhostUserDaemon::new(format!("vhost {name} conn"), backend.clone(), mem) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!("{name}: vhost-user-blk: {e}");
                return;
            }
        };
        if let Err(e) = daemon.start(&mut listener) {
            tracing::warn!("{name}: vhost-user-blk on {}: {e}", socket.display());
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        }
        if shared.stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
            let _ = daemon.wait();
            break;
        }
        *shared.conn.lock().unpoisoned() = daemon.shutdown_handle().map(|h| (h, backend));
        tracing::info!("{name}: a vhost-user frontend connected on {}", socket.display());
        let r = daemon.wait();
        *shared.conn.lock().unpoisoned() = None;
        match r {
            Ok(()) => tracing::info!("{name}: the vhost-user frontend disconnected"),
            Err(e) => tracing::warn!("{name}: the vhost-user frontend's connection ended: {e}"),
        }
        // dropping the daemon stops and joins the connection's queue threads
        drop(daemon);
    }
}
