//! /dev/ublk-control: the driver's control commands, each a URING_CMD in a
//! 128-byte SQE (the 32-byte command does not fit a plain one) on a small ring
//! of the caller's, waited for at once. Control is rare; nothing here is on the
//! request path.

use super::sys::{self, CtrlCmd, DevInfo, Params};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

pub struct Control {
    file: File,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
}

/// Why ublk cannot be used here, in words a user can act on.
pub fn open_error(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::ENXIO) => format!(
            "ublk is not available: {} does not exist (load the driver with `modprobe ublk_drv`; Linux 6.5 or later)",
            sys::CONTROL
        ),
        Some(libc::EACCES) | Some(libc::EPERM) => format!(
            "no permission to open {}: attaching a block device needs root (or CAP_SYS_ADMIN)",
            sys::CONTROL
        ),
        _ => format!("cannot open {}: {e}", sys::CONTROL),
    }
}

impl Control {
    pub fn open() -> Result<Control, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(sys::CONTROL)
            .map_err(|e| open_error(&e))?;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build(4)
            .map_err(|e| format!("ublk needs io_uring, which this system refuses: {e}"))?;
        Ok(Control { file, ring })
    }

    /// Run one command; the driver's result (>= 0) or its errno.
    fn cmd(&mut self, op: u32, c: CtrlCmd) -> io::Result<i32> {
        let e = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op)
            .cmd(c.bytes())
            .build()
            .user_data(1);
        // SAFETY: the command names `c.addr` (the caller's buffer, alive across
        // this call, which waits for the completion) and nothing else.
        unsafe {
            self.ring
                .submission()
                .push(&e)
                .map_err(|_| io::Error::other("ublk control ring full"))?;
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
        let res = self
            .ring
            .completion()
            .next()
            .map(|c| c.result())
            .ok_or_else(|| io::Error::other("ublk control: no completion"))?;
        if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            Ok(res)
        }
    }

    fn dev_cmd(&mut self, op: u32, dev_id: u32, data: u64) -> io::Result<i32> {
        self.cmd(
            op,
            CtrlCmd {
                dev_id,
                queue_id: u16::MAX,
                data,
                ..Default::default()
            },
        )
    }

    /// The driver's features (UBLK_U_CMD_GET_FEATURES, Linux 6.5+); 0 before it.
    pub fn features(&mut self) -> u64 {
        let mut f = 0u64;
        let c = CtrlCmd {
            dev_id: u32::MAX,
            queue_id: u16::MAX,
            len: 8,
            addr: std::ptr::from_mut(&mut f) as u64,
            ..Default::default()
        };
        match self.cmd(sys::CMD_GET_FEATURES, c) {
            Ok(_) => f,
            Err(_) => 0,
        }
    }

    /// ADD_DEV: the driver fills in the rest of `info` (its id above all).
    pub fn add(&mut self, info: &mut DevInfo) -> io::Result<()> {
        let c = CtrlCmd {
            dev_id: info.dev_id,
            queue_id: u16::MAX,
            len: std::mem::size_of::<DevInfo>() as u16,
            addr: std::ptr::from_mut(info) as u64,
            ..Default::default()
        };
        self.cmd(sys::CMD_ADD_DEV, c).map(drop)
    }

    pub fn info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut info = DevInfo::default();
        let c = CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len: std::mem::size_of::<DevInfo>() as u16,
            addr: std::ptr::from_mut(&mut info) as u64,
            ..Default::default()
        };
        self.cmd(sys::CMD_GET_DEV_INFO, c)?;
        Ok(info)
    }

    pub fn set_params(&mut self, dev_id: u32, p: &mut Params) -> io::Result<()> {
        p.len = std::mem::size_of::<Params>() as u32;
        let c = CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len: p.len as u16,
            addr: std::ptr::from_mut(p) as u64,
            ..Default::default()
        };
        self.cmd(sys::CMD_SET_PARAMS, c).map(drop)
    }

    /// START_DEV: returns once every queue has fetched its requests and the disk
    /// is added (its partition scan is served meanwhile by the queues).
    pub fn start(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_cmd(sys::CMD_START_DEV, dev_id, std::process::id().into())
            .map(drop)
    }

    pub fn stop(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_cmd(sys::CMD_STOP_DEV, dev_id, 0).map(drop)
    }

    /// DEL_DEV: waits until /dev/ublkcN is closed by everyone.
    pub fn delete(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_cmd(sys::CMD_DEL_DEV, dev_id, 0).map(drop)
    }

    pub fn start_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_cmd(sys::CMD_START_USER_RECOVERY, dev_id, 0).map(drop)
    }

    pub fn end_recovery(&mut self, dev_id: u32) -> io::Result<()> {
        self.dev_cmd(sys::CMD_END_USER_RECOVERY, dev_id, std::process::id().into())
            .map(drop)
    }
}
