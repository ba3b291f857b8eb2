# Compiled-only declarations for normal_fit.py (see policy.pxd).
cimport cython


@cython.locals(s0=double, s1=double, s2=double, g00=double, g01=double, g02=double,
               g11=double, g12=double, g22=double, r0=double, r1=double, r2=double,
               j=Py_ssize_t, a=double, b=double, c=double, v=double)
cdef tuple _ring_gram(double[::1] xr, double[::1] yr, Py_ssize_t start, Py_ssize_t rows,
                      Py_ssize_t stride, list scales)


@cython.locals(s0=double, s1=double, s2=double, w0=double, w1=double, w2=double,
               total=double, j=Py_ssize_t, e=double)
cdef double _ring_residual(double[::1] xr, Py_ssize_t start, Py_ssize_t rows,
                           Py_ssize_t stride, list scales, list w) except? -1.0


@cython.locals(k=Py_ssize_t, rows=Py_ssize_t, cut=double, top=double, p=Py_ssize_t,
               i=Py_ssize_t, m=Py_ssize_t, v=double, diag=double, nb=Py_ssize_t, d=double,
               x=double, norm=double, gp=list, row=list, basis=list, lo=list, piv=list,
               nulls=list, w=list, z=list, sol=list, ortho=list, nv=list, q=list,
               full=list, res=double, start=Py_ssize_t, stride=Py_ssize_t, scales=list)
cdef object _least_squares(list g, list r, list active, tuple ring)


@cython.locals(i=Py_ssize_t, g=list, r=list, active=list, coef=list, sol=list, kept=list)
cpdef object normal_nnls(double[::1] xr, double[::1] yr, Py_ssize_t start, Py_ssize_t rows,
                          Py_ssize_t stride, list scales)
