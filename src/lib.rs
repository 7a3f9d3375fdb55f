//! dmkit: Linux device-mapper in userspace, served over NBD.
pub mod pdata;
pub mod thin;
