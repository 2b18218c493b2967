//! How the domain's text-valued types are stored: as their names, bound and read directly, so a
//! status or step address never passes through SQL as a string spelled by hand, and a name this
//! build does not know fails the read instead of being guessed.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

use crate::domain::{RunStatus, StepAddress};

macro_rules! stored_as_text {
    ($ty:ty, $parse:expr) => {
        impl Type<Postgres> for $ty {
            fn type_info() -> PgTypeInfo {
                <String as Type<Postgres>>::type_info()
            }
            fn compatible(ty: &PgTypeInfo) -> bool {
                <String as Type<Postgres>>::compatible(ty)
            }
        }

        impl PgHasArrayType for $ty {
            fn array_type_info() -> PgTypeInfo {
                <String as PgHasArrayType>::array_type_info()
            }
            fn array_compatible(ty: &PgTypeInfo) -> bool {
                <String as PgHasArrayType>::array_compatible(ty)
            }
        }

        impl Encode<'_, Postgres> for $ty {
            fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
                let text: &str = self.as_str();
                <&str as Encode<Postgres>>::encode_by_ref(&text, buf)
            }
        }

        impl Decode<'_, Postgres> for $ty {
            fn decode(value: PgValueRef<'_>) -> Result<Self, BoxDynError> {
                let text = <String as Decode<Postgres>>::decode(value)?;
                $parse(text)
            }
        }
    };
}

stored_as_text!(RunStatus, |t: String| Ok(RunStatus::try_from(t)?));
stored_as_text!(StepAddress, |t: String| Ok(StepAddress::from(t)));
