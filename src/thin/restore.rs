//! `thin_restore`: build metadata from thin_dump XML through the API.

use super::error::{Result, ThinError};
use super::metadata::{FormatOptions, ThinPoolMetadata, DEFAULT_CACHE_BLOCKS};
use super::superblock::DeviceDetails;
use super::xml::XmlMetadata;
use crate::pdata::MetadataDev;

pub fn restore(md_xml: &XmlMetadata, dev: Box<dyn MetadataDev>) -> Result<ThinPoolMetadata> {
    let sb = &md_xml.superblock;
    let mut md = ThinPoolMetadata::format(
        dev,
        FormatOptions {
            data_block_size: sb.data_block_size,
            nr_data_blocks: sb.nr_data_blocks,
            cache_blocks: DEFAULT_CACHE_BLOCKS,
        },
    )?;
    md.set_time(sb.time);
    md.set_transaction_id(0, sb.transaction)?;
    md.set_flags(sb.flags);
    md.set_version(sb.version);
    for d in &md_xml.devices {
        md.create_thin(d.dev_id)?;
        let mut prev = None;
        for &(v, b, t) in &d.mappings {
            if prev.is_some_and(|p| p >= v) {
                return Err(ThinError::Invalid(format!(
                    "device {}: mappings not in ascending order at block {v}",
                    d.dev_id
                )));
            }
            prev = Some(v);
            md.insert_shared(d.dev_id, v, b, t)?;
        }
        md.set_device_details(
            d.dev_id,
            DeviceDetails {
                mapped_blocks: 0,
                transaction_id: d.transaction,
                creation_time: d.creation_time,
                snapshotted_time: d.snap_time,
            },
        )?;
    }
    md.commit()?;
    Ok(md)
}
