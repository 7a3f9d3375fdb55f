//! What a target and the registry refuse, typed as the kernel refuses: an
//! errno and one line. A constructor sets `ti->error` and returns `-EINVAL` (or `-ENOMEM`,
//! `-EBUSY`, ...); a message, a preresume or a status query returns an errno and
//! logs why. dmkit carries both from the target to the control socket and the
//! dm ioctl door, so `dmsetup` sees the kernel's errno without anyone reading
//! the text to recover it.

use crate::table::TableError;
use std::fmt;

/// A target's refusal: the errno (positive, as `errno` holds it) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetError {
    errno: i32,
    what: String,
}

impl TargetError {
    pub fn new(errno: i32, what: impl Into<String>) -> TargetError {
        TargetError {
            errno,
            what: what.into(),
        }
    }

    /// EINVAL: the arguments or the request are wrong (most refusals).
    pub fn invalid(what: impl Into<String>) -> TargetError {
        TargetError::new(libc::EINVAL, what)
    }

    /// EBUSY: something else holds what the request needs.
    pub fn busy(what: impl Into<String>) -> TargetError {
        TargetError::new(libc::EBUSY, what)
    }

    /// EEXIST: the request would make something that is already there.
    pub fn exists(what: impl Into<String>) -> TargetError {
        TargetError::new(libc::EEXIST, what)
    }

    /// ENODATA: what the request names is not there (thin's unknown device id).
    pub fn no_data(what: impl Into<String>) -> TargetError {
        TargetError::new(libc::ENODATA, what)
    }

    /// ENOSPC: no room left (a full pool or journal).
    pub fn no_space(what: impl Into<String>) -> TargetError {
        TargetError::new(libc::ENOSPC, what)
    }

    /// EIO: the metadata or a device below failed.
    pub fn io(what: impl Into<String>) -> TargetError {
        TargetError::new(libc::EIO, what)
    }

    /// The errno the kernel's target would return.
    pub fn errno(&self) -> i32 {
        self.errno
    }

    /// The one line that says why.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The same refusal with `context` in front of its line (`device 'x': ...`).
    pub fn context(self, context: impl fmt::Display) -> TargetError {
        TargetError {
            errno: self.errno,
            what: format!("{context}: {}", self.what),
        }
    }
}

impl fmt::Display for TargetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

impl std::error::Error for TargetError {}

/// A refusal given only as a line is EINVAL, as a kernel target's constructor
/// that sets `ti->error` returns unless it says otherwise.
impl From<String> for TargetError {
    fn from(what: String) -> TargetError {
        TargetError::invalid(what)
    }
}

impl From<&str> for TargetError {
    fn from(what: &str) -> TargetError {
        TargetError::invalid(what)
    }
}

/// A structure too short for its fields: EINVAL, naming the field.
impl From<crate::layout::LayoutError> for TargetError {
    fn from(e: crate::layout::LayoutError) -> TargetError {
        TargetError::invalid(e.to_string())
    }
}

/// An I/O error keeps its errno (EIO when it has none).
impl From<std::io::Error> for TargetError {
    fn from(e: std::io::Error) -> TargetError {
        TargetError::new(e.raw_os_error().unwrap_or(libc::EIO), e.to_string())
    }
}

/// What the registry refuses (create, load, resume, remove, message, ...),
/// each with the errno the kernel's dm ioctl answers.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{0}: No such device")]
    NoDevice(String),
    #[error("{0}: device already exists")]
    Exists(String),
    #[error("{0}")]
    Table(#[from] TableError),
    /// Refused for device `name` with `errno` (positive), and why.
    #[error("{name}: {what}")]
    Device { name: String, errno: i32, what: String },
    /// A request that names no device and is wrong in itself.
    #[error("{0}")]
    Usage(String),
}

impl ControlError {
    /// The errno the kernel's dm ioctl answers with.
    pub fn errno(&self) -> i32 {
        match self {
            ControlError::NoDevice(_) => libc::ENXIO,
            ControlError::Exists(_) => libc::EBUSY,
            ControlError::Device { errno, .. } => *errno,
            ControlError::Table(t) => t.errno(),
            ControlError::Usage(_) => libc::EINVAL,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_einval_and_context_keeps_the_errno() {
        let e: TargetError = "bad block size".into();
        assert_eq!((e.errno(), e.what()), (libc::EINVAL, "bad block size"));
        let b = TargetError::busy("in use").context("device 'p'");
        assert_eq!(
            (b.errno(), b.to_string().as_str()),
            (libc::EBUSY, "device 'p': in use")
        );
        let io: TargetError = std::io::Error::from_raw_os_error(libc::ENOSPC).into();
        assert_eq!(io.errno(), libc::ENOSPC);
    }
}
